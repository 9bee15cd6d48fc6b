"""Batched multi-LoRA: every token of a flat batch gets its own adapter's low-rank update
y += B[slot] @ (A[slot] @ x): a shrink and an expand launch per projection (punica-style),
or, at a few tokens, one launch doing both.

Adapters live in S slots: A stacked [S, R, K] (R = n_slices * rank rows, [A_q; A_k; A_v] for
a merged qkv layer, each zero-padded to the engine's max rank) and B [S, N, rank] (the merged
layer's output rows; the LoRA scaling already folded in). `token_slots` [T] int32 names each
token's slot, -1 for none; it is read on the device only, so a CUDA graph holds the calls and
the buffer can be rewritten in place between replays. So can the optional `token_order` [T]
int32, a permutation of range(T) that lists the tokens grouped by slot (LoRABatch builds both).

- `lora_shrink`: out [T, R] fp32 = A[slot] @ x per token (0 for slot -1).
- `lora_expand`: y[:, slice j] += B[slot][slice j rows] @ out[:, j*rank:(j+1)*rank], every
  slice in the same launch (a grid axis over slices); tokens with slot -1 are not touched.
- `lora_shrink_expand`: both in one launch, for T <= FUSED_MAX_T (the projections' choice).

Variants, by token count (the wrappers pick them as constexprs, so each compiles once):
- fused (`lora_shrink_expand`): one program per token and column tile of one slice. It
  computes that slice's `rank` values of A x itself, then adds its tile of B @ them to y. The
  shrink is thus redone once per column tile (its A slice comes from L2 after the first), in
  exchange for the second launch: at batch 1 a LoRA kernel is ~2 us of launch and latency and
  well under a microsecond of bytes. Wide tiles (512 columns at rank 16) keep the redundancy
  down, and a long K (down_proj's 14336) is split over programs with the ticket reduction
  below, so that no program streams a long A slice alone.
- per-token (BLOCK_M = 1, T <= PER_TOKEN_MAX_T): one program per token and tile of rows, a
  broadcast multiply + sum on the CUDA cores (BGMV). Few tokens leave tl.dot's 16 rows mostly
  padding, and a decode batch's few tokens mostly have adapters of their own anyway.
- block (T > PER_TOKEN_MAX_T; BLOCK_M = 16 when sorted up to SORTED_16_MAX_T tokens, else
  32 up to 1024 and 64 beyond, at most 32 in expand): a program owns BLOCK_M tokens,
  consecutive or, with `token_order`, the next BLOCK_M of the slot-sorted order (gathered
  rows of x, buf and y, written back to the same rows). A block of one slot makes one tl.dot
  pass with that slot's weights; a block that holds several makes one pass per distinct slot
  (the next one is the least slot above the current) over all its rows, and keeps each row's
  result from its own slot's pass; a block of only slot -1 makes none (shrink stores zeros,
  expand returns). In flat-batch order a prefill's requests are runs of one slot, but a
  decode batch over several adapters interleaves them, so every block would pay one pass per
  slot; sorted, a launch reads each adapter's weights about once per block it spans (blocks +
  slots - 1 passes in all, against T weight reads for the per-token variant).

Under PDL (kernels/_common), the slot maps and the weights are read before waiting on the
kernel before (griddepcontrol.wait), so their latency hides behind that kernel's tail: the
fused kernel and the per-token variants fetch their slot, their B tile and their first A tile
early; blocks fetch their slots (and expand its first B tile). None of these may be written by
the kernel launched just before (LoRABatch writes the maps by host copies before the step;
the weights are loaded before the step). x, y and buf are read after the wait.

The shrink reads all of x for a few rows of output, so at few tokens its tiles are few; it
then splits K over up to _MAX_SPLIT programs per tile, and the last of them to finish sums
the fp32 partials in split order (ticket counters, as folio.model.kernels.gemv's split-K:
deterministic, one set per device, so split shrinks must not run on two streams at once).
The fused kernel splits K the same way, per (token, column tile).
The expand reads y once and writes it once; its rank-wide product is small next to that.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, pdl_launch,
                                         require_triton, tl, triton)

# The projections (folio/model/lora/projection.py) use the fused kernel up to this many tokens.
# Its redundant shrink reads grow with T times the column tiles: at 4 tokens gate_up's (56
# tiles of 512 at rank 16) are ~29 MB of L2 reads, about the cost of the launch it saves.
FUSED_MAX_T = 4
# Up to this many tokens, the per-token (BGMV) variant; beyond it (slot-sorted) tl.dot blocks.
# A block makes its passes (one per distinct slot) one after another, each a chain of
# dependent loads, while per-token programs all run at once: up to 16 tokens a decode batch
# over 8 adapters fits one sorted block of 8 serial passes, slower than 16 parallel per-token
# reads of A from L2 (~6 MB for qkv). Past it, sorted blocks hold several tokens per slot (4
# serial passes at 32 tokens, 2 at 64), and read each adapter's weights about once per block
# where the per-token variant reads them once per token (25 MB for qkv at 64).
PER_TOKEN_MAX_T = 16
# Sorted blocks of 16 rows (tl.dot's least) up to this many tokens: the passes are about
# blocks + slots - 1 whatever BLOCK_M is, so the smallest blocks give the most programs and
# the least padding per pass; past it (prefills: long runs of one slot) 32 or 64 rows.
SORTED_16_MAX_T = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-K of the shrink: at most _MAX_SPLIT splits, aiming at _TARGET_PROGRAMS programs (a
# few per SM), for grids of at most _COUNTERS tiles (one ticket counter each).
_MAX_SPLIT = 16
_TARGET_PROGRAMS = 512
_COUNTERS = 1024
# The fused kernel's K range per program: K is split over programs (ticket reduction) so that
# each covers at most 1024 columns (4 steps of 256 at rank 16, the first before the PDL wait).
# Its loads feed no tl.dot, so nothing pipelines them but the program's own next-tile
# prefetch: one unsplit program would wait out 16 dependent L2/HBM round trips on K = 4096.
_FUSED_K_PER_PROGRAM = 1024

if HAS_TRITON:
    from folio.model.kernels._common import load_k_tile, pdl_entry

    @triton.jit
    def _k_range(pid_k, K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """This program's [k_lo, k_hi) of K. Split boundaries fall on whole tiles, so only the
        tile at K is ragged, and a last split may be empty (k_lo >= K)."""
        K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K \
            * BLOCK_K
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        return k_lo, k_hi

    @triton.jit
    def _first_tile(rows, k_lo, k_hi, BLOCK_K: tl.constexpr):
        """The first [R, BLOCK_K] tile of the range [k_lo, k_hi), zeros past k_hi."""
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        return tl.load(rows + offs_k[None, :], mask=(offs_k < k_hi)[None, :], other=0.0)

    @triton.jit
    def _first_tile_if(rows, k_lo, k_hi, ok, BLOCK_K: tl.constexpr):
        """_first_tile, all zeros (and no memory traffic) when the scalar `ok` is false."""
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        return tl.load(rows + offs_k[None, :], mask=ok & (offs_k < k_hi)[None, :], other=0.0)

    @triton.jit
    def _row_dot(a_first, a_rows, x_rows, k_lo, k_hi, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """[R] fp32 sums over [k_lo, k_hi) of A's rows times one row of x, given A's first
        tile (loaded early): elementwise partial sums, reduced once after the loop. x_rows
        repeats the token's row R times: each thread loads the x elements its A elements
        meet (L1 hits), where a [1, BLOCK_K] x would be moved between layouts through shared
        memory at every step. The next tiles load before this one's products (Triton does
        not pipeline loads that feed no tl.dot): two tiles in flight per program."""
        a = a_first
        x = _first_tile(x_rows, k_lo, k_hi, BLOCK_K)
        part = tl.zeros(a_first.shape, dtype=tl.float32)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_next = load_k_tile(a_rows, offs_k, K, BLOCK_K)
            x_next = load_k_tile(x_rows, offs_k, K, BLOCK_K)
            part += a.to(tl.float32) * x.to(tl.float32)
            a = a_next
            x = x_next
        part += a.to(tl.float32) * x.to(tl.float32)
        return tl.sum(part, axis=1)

    @triton.jit
    def _next_slot(slots, current, hi):
        """The least slot of the block above `current`; hi + 1 when none is left."""
        return tl.min(tl.where(slots > current, slots, hi + 1))

    @triton.jit
    def _block_tokens(ORDER, rows_m, T, ORDERED: tl.constexpr):
        """A block's tokens (rows of x, buf, y, token_slots) and which of them are real: the
        block's positions themselves, or their entries of the slot-sorted order. Unreal rows
        read token 0 and are never stored."""
        ok = rows_m < T
        if ORDERED:
            toks = tl.load(ORDER + rows_m, mask=ok, other=0)
            # a permutation of range(T) has no other entries; guard memory all the same
            ok = ok & (toks >= 0) & (toks < T)
            toks = tl.where(ok, toks, 0)
        else:
            toks = tl.where(ok, rows_m, 0)
        return toks, ok

    @triton.jit
    def _split_sum(acc, P, C, counter, p_off, p_mask, split_stride, pid_k,
                   SPLIT_K: tl.constexpr):
        """Store this program's fp32 partial of a split-K sum; a ticket counter tells the
        last of the SPLIT_K programs to finish, which gets the sum of the partials in split
        order (the same bits whatever order the programs ran in: the atomic only counts)
        and resets the counter for the next launch. Returns (is_last, total)."""
        tl.store(P + pid_k * split_stride + p_off, acc, mask=p_mask)
        # Every thread's partial is written before the (single-thread) ticket release.
        tl.debug_barrier()
        ticket = tl.atomic_add(C + counter, 1, sem="acq_rel")
        is_last = ticket == SPLIT_K - 1
        total = tl.zeros_like(acc)
        if is_last:
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, never a stale L1 line of an earlier launch
                total += tl.load(P + s * split_stride + p_off, mask=p_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(C + counter, 0)
        return is_last, total

    @triton.jit
    def _shrink_store(acc, OUT, P, C, tile, pid_k, rows_m, toks, ok, rows_r, T, stride_ot,
                      R: tl.constexpr, SPLIT_K: tl.constexpr):
        """Store a [BLOCK_M, BLOCK_R] tile of out to rows `toks` (where `ok`); split over K,
        through _split_sum, the partials indexed by block position `rows_m`."""
        mask = ok[:, None] & (rows_r < R)[None, :]
        o_ptrs = OUT + toks.to(tl.int64)[:, None] * stride_ot + rows_r[None, :]
        if SPLIT_K == 1:
            tl.store(o_ptrs, acc, mask=mask)
        else:
            p_off = rows_m.to(tl.int64)[:, None] * R + rows_r[None, :]
            is_last, total = _split_sum(acc, P, C, tile, p_off, mask, T.to(tl.int64) * R,
                                        pid_k, SPLIT_K)
            if is_last:
                tl.store(o_ptrs, total, mask=mask)

    @triton.jit(do_not_specialize=["T"])
    def _shrink_kernel(X, A, SLOTS, ORDER, OUT, P, C, T, stride_xt, stride_as, stride_ar,
                       stride_ot, R: tl.constexpr, K: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, ORDERED: tl.constexpr, USE_PDL: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_r = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        k_lo, k_hi = _k_range(pid_k, K, BLOCK_K, SPLIT_K)
        # Rows of A past R read a valid row (clamped) and are never stored: no row masks.
        a_off = tl.minimum(rows_r, R - 1).to(tl.int64)[:, None] * stride_ar
        if BLOCK_M == 1:
            toks = rows_m
            ok = rows_m < T
            slot = tl.load(SLOTS + pid_m)
            a_rows = A + tl.maximum(slot, 0).to(tl.int64) * stride_as + a_off
            a_first = _first_tile_if(a_rows, k_lo, k_hi, slot >= 0, BLOCK_K)
            pdl_entry(USE_PDL)
            acc = tl.zeros((1, BLOCK_R), dtype=tl.float32)
            if slot >= 0:
                x_rows = X + pid_m.to(tl.int64) * stride_xt + tl.zeros_like(a_off)
                acc = _row_dot(a_first, a_rows, x_rows, k_lo, k_hi, K, BLOCK_K)[None, :]
        else:
            toks, ok = _block_tokens(ORDER, rows_m, T, ORDERED)
            slots = tl.load(SLOTS + toks, mask=ok, other=-1)
            pdl_entry(USE_PDL)
            hi = tl.max(slots)
            slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
            x_rows = X + toks.to(tl.int64)[:, None] * stride_xt
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            while slot <= hi:
                a_rows = A + slot.to(tl.int64) * stride_as + a_off
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = load_k_tile(x_rows, offs_k, K, BLOCK_K)
                    a = load_k_tile(a_rows, offs_k, K, BLOCK_K)
                    part = tl.dot(x, tl.trans(a), part, input_precision=PRECISION)
                acc = tl.where((slots == slot)[:, None], part, acc)
                slot = _next_slot(slots, slot, hi)
        _shrink_store(acc, OUT, P, C, pid_m * tl.num_programs(1) + pid_r, pid_k, rows_m, toks,
                      ok, rows_r, T, stride_ot, R, SPLIT_K)

    @triton.jit
    def _slice_of(pid_j, SLICES: tl.constexpr):
        """Slice pid_j's first output row and its size."""
        off = 0
        size = 0
        for j in tl.static_range(len(SLICES)):
            off = tl.where(pid_j > j, off + SLICES[j], off)
            size = tl.where(pid_j == j, SLICES[j], size)
        return off, size

    @triton.jit
    def _add_delta(Y, row, cols, c_ok, b, u, stride_yt):
        """y[row, cols] += b [BLOCK_N, RANK_PAD] @ u [RANK_PAD] in fp32, rounded once."""
        delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1)
        y_ptrs = Y + row.to(tl.int64) * stride_yt + cols
        y = tl.load(y_ptrs, mask=c_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=c_ok)

    @triton.jit(do_not_specialize=["T"])
    def _expand_kernel(BUF, B, SLOTS, ORDER, Y, T, stride_ut, stride_bs, stride_bn, stride_yt,
                       SLICES: tl.constexpr, RANK: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
                       U_SLOT_STRIDE: tl.constexpr, U_MODE: tl.constexpr,
                       ORDERED: tl.constexpr, USE_PDL: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_j = tl.program_id(2)
        # This program's slice: rows [off, off + size) of y and B, buf columns pid_j * RANK...
        off, size = _slice_of(pid_j, SLICES)
        # The grid's column axis covers the widest slice; the others' extra programs leave.
        if pid_n * BLOCK_N >= size:
            return
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < size
        ranks = tl.arange(0, RANK_PAD)
        k_mask = (ranks < RANK)[None, :]
        # Columns past the slice read a valid row of B (clamped) and are never stored.
        b_off = (off + tl.minimum(cols, size - 1)).to(tl.int64)[:, None] * stride_bn \
            + ranks[None, :]
        u_cols = pid_j * RANK + ranks
        if BLOCK_M == 1:
            slot = tl.load(SLOTS + pid_m)
            b = tl.load(B + tl.maximum(slot, 0).to(tl.int64) * stride_bs + b_off,
                        mask=k_mask & (slot >= 0), other=0.0)
            pdl_entry(USE_PDL)
            if slot >= 0:
                u = tl.load(BUF + pid_m.to(tl.int64) * stride_ut + slot * U_SLOT_STRIDE
                            + u_cols, mask=ranks < RANK, other=0.0).to(tl.float32)
                _add_delta(Y, pid_m, off + cols, c_ok, b, u, stride_yt)
        else:
            rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            toks, ok = _block_tokens(ORDER, rows_m, T, ORDERED)
            slots = tl.load(SLOTS + toks, mask=ok, other=-1)
            hi = tl.max(slots)
            slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
            b = tl.load(B + slot.to(tl.int64) * stride_bs + b_off, mask=k_mask & (hi >= 0),
                        other=0.0)
            pdl_entry(USE_PDL)
            if hi >= 0:
                y_ptrs = Y + toks.to(tl.int64)[:, None] * stride_yt + off + cols[None, :]
                y_mask = (ok & (slots >= 0))[:, None] & c_ok[None, :]
                # y is the bulk of the bytes: its load goes out first.
                y = tl.load(y_ptrs, mask=y_mask, other=0.0)
                u = tl.load(BUF + toks.to(tl.int64)[:, None] * stride_ut
                            + (tl.maximum(slots, 0) * U_SLOT_STRIDE)[:, None] + u_cols[None, :],
                            mask=k_mask, other=0.0)
                delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                while slot <= hi:
                    following = _next_slot(slots, slot, hi)
                    # The next slot's tile (if any) loads while this one's product runs.
                    b_next = tl.load(B + tl.minimum(following, hi).to(tl.int64) * stride_bs
                                     + b_off, mask=k_mask & (following <= hi), other=0.0)
                    if U_MODE == 1:
                        # bf16: u as the sum of two bf16 terms (16 significant bits, the
                        # rest below y's rounding) against b as it is, accumulated in fp32:
                        # 1.3-1.4x faster on an H200 than tf32x3 on b widened to fp32.
                        u_hi = u.to(b.dtype)
                        u_lo = (u - u_hi.to(tl.float32)).to(b.dtype)
                        part = tl.dot(u_lo, tl.trans(b), tl.dot(u_hi, tl.trans(b)))
                    elif U_MODE == 2:
                        # u already in b's 16-bit dtype: one product, accumulated in fp32
                        part = tl.dot(u, tl.trans(b))
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

    @triton.jit(do_not_specialize=["T"])
    def _fused_kernel(X, A, B, SLOTS, Y, P, C, T, stride_xt, stride_as, stride_ar, stride_bs,
                      stride_bn, stride_yt, SLICES: tl.constexpr, RANK: tl.constexpr,
                      K: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)   # column tile, counted over all slices in order
        pid_k = tl.program_id(2)
        # Tile pid_n's slice j: rows [off, off + size) of y and B, rows j * RANK... of A, and
        # the tile's first column within the slice.
        j = 0
        off = 0
        size = 0
        col0 = 0
        first_tile = 0
        first_row = 0
        for s in tl.static_range(len(SLICES)):
            n_tiles = (SLICES[s] + BLOCK_N - 1) // BLOCK_N
            mine = (pid_n >= first_tile) & (pid_n < first_tile + n_tiles)
            j = tl.where(mine, s, j)
            off = tl.where(mine, first_row, off)
            size = tl.where(mine, SLICES[s], size)
            col0 = tl.where(mine, (pid_n - first_tile) * BLOCK_N, col0)
            first_tile += n_tiles
            first_row += SLICES[s]
        cols = col0 + tl.arange(0, BLOCK_N)
        c_ok = cols < size
        ranks = tl.arange(0, RANK_PAD)
        k_lo, k_hi = _k_range(pid_k, K, BLOCK_K, SPLIT_K)
        slot = tl.load(SLOTS + pid_t)
        base = tl.maximum(slot, 0).to(tl.int64)
        # The weights are no kernel's output: under PDL the B tile and A's first tile stream
        # in while the kernel before finishes. Ranks past RANK read a valid row of A (clamped;
        # their sums meet B's zeroed columns) and columns past the slice a valid row of B.
        b = tl.load(B + base * stride_bs
                    + (off + tl.minimum(cols, size - 1)).to(tl.int64)[:, None] * stride_bn
                    + ranks[None, :], mask=(ranks < RANK)[None, :] & (slot >= 0), other=0.0)
        a_rows = A + base * stride_as \
            + (j * RANK + tl.minimum(ranks, RANK - 1)).to(tl.int64)[:, None] * stride_ar
        a_first = _first_tile_if(a_rows, k_lo, k_hi, slot >= 0, BLOCK_K)
        pdl_entry(USE_PDL)
        if slot >= 0:
            x_rows = X + pid_t.to(tl.int64) * stride_xt \
                + tl.zeros((RANK_PAD, 1), dtype=tl.int64)
            u = _row_dot(a_first, a_rows, x_rows, k_lo, k_hi, K, BLOCK_K)
            is_last = True
            if SPLIT_K > 1:
                counter = pid_t * tl.num_programs(1) + pid_n
                is_last, u = _split_sum(u, P, C, counter, counter.to(tl.int64) * RANK_PAD
                                        + ranks, ranks < RANK_PAD,
                                        T.to(tl.int64) * tl.num_programs(1) * RANK_PAD,
                                        pid_k, SPLIT_K)
            if is_last:
                _add_delta(Y, pid_t, off + cols, c_ok, b, u, stride_yt)


def _block_m(t: int, ordered: bool) -> int:
    """Token rows per program for t tokens (1: the per-token variant); `ordered`: the rows
    come slot-sorted through token_order."""
    if t <= PER_TOKEN_MAX_T:
        return 1
    if INTERPRET:  # the tests' token counts cross several 16-row blocks
        return 16
    if ordered and t <= SORTED_16_MAX_T:
        return 16
    return 32 if t <= 1024 else 64


def _shrink_tiles(t: int, r: int, k: int, block_m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, num_warps) for x [t, k] against r rows of A, in
    the variant of `block_m`."""
    if INTERPRET:  # small tiles: quick, and ragged against the tests' shapes
        return (1, 4, 32, 1, 4) if block_m == 1 else (block_m, 16, 32, 1, 4)
    if block_m == 1:
        # A few rows of A per program, so that even one token spreads over many programs.
        block_r, block_k = 8, 256
    else:
        block_r, block_k = 16, 64
    # Few tiles (few tokens, a narrow A) leave SMs idle: split K until the programs cover
    # them, keeping at least two K tiles per split.
    tiles = triton.cdiv(t, block_m) * triton.cdiv(r, block_r)
    split = 1
    if tiles <= _COUNTERS:
        split = max(1, min(_MAX_SPLIT, _TARGET_PROGRAMS // tiles, k // (2 * block_k)))
    return block_m, block_r, block_k, split, 4


def _expand_tiles(t: int, rank: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for t tokens at this rank, in the variant of `block_m`
    (at most 32 rows: y's [BLOCK_M, BLOCK_N] tile is the bytes, and wider tiles of more
    columns serve as well)."""
    if INTERPRET:
        return (block_m, 16, 4)
    if block_m == 1:
        return 1, min(256, max(32, 4096 // next_pow2(rank))), 4
    if block_m == 16:   # sorted decode blocks: the same y tile as 32 x 64
        return 16, 128, 4
    return (32, 64, 4) if t <= 256 else (32, 128, 4)


def _fused_tiles(k: int, rank: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) of lora_shrink_expand for K = k at this rank."""
    if INTERPRET:  # ragged against the tests' slices and K
        return 32, 16, 1, 4
    rank_pad = next_pow2(rank)
    # B's [BLOCK_N, rank] tile and A's [rank, BLOCK_K] tiles stay at 8192 and 4096 elements
    # (32 and 16 registers a thread at 4 warps): 512 x 256 at rank 16. Wide column tiles
    # keep the redundant shrinks few (gate_up: 56 at T = 1); each split program also loads
    # its tile's B, so the splits multiply B's reads (from L2 after the first).
    block_n = min(512, max(64, 8192 // rank_pad))
    block_k = min(512, max(32, 4096 // rank_pad))
    split = min(_MAX_SPLIT, triton.cdiv(k, max(_FUSED_K_PER_PROGRAM, block_k)))
    return block_n, block_k, split, 4


_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    """int32 ticket counters of the split-K shrinks, one per tile, zero between launches (the
    last program of each tile resets its own). One set per device: split shrinks must not
    run concurrently on two streams."""
    key = (device.type, device.index)
    counters = _counters.get(key)
    if counters is None:
        counters = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


def _check_map(name: str, m: torch.Tensor, t: int) -> None:
    if m.shape != (t,) or m.dtype != torch.int32 or not m.is_contiguous():
        raise ValueError(f"{name} must be contiguous int32 [{t}], got "
                         f"{tuple(m.shape)} {m.dtype}")


def _check_shrink_side(fn: str, x: torch.Tensor, a: torch.Tensor) -> None:
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"{fn} needs x [T, K] and a [S, R, K], got {tuple(x.shape)} "
                         f"and {tuple(a.shape)}")
    if x.dtype not in _DTYPES or a.dtype != x.dtype:
        raise ValueError(f"x and a must share a float dtype, got {x.dtype} and {a.dtype}")
    if a.stride(2) != 1:
        raise ValueError(f"{fn} needs a's rows contiguous")


def _check_expand_side(fn: str, b: torch.Tensor, y: torch.Tensor,
                       slice_sizes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The slice sizes as ints, after checking b and y against them."""
    slice_sizes = tuple(int(s) for s in slice_sizes)
    if not slice_sizes or min(slice_sizes) < 1 or rank < 1:
        raise ValueError(f"{fn} needs slices and a rank >= 1, got {slice_sizes}, {rank}")
    n = sum(slice_sizes)
    if y.dim() != 2 or y.shape[1] != n or b.dim() != 3 or b.shape[1:] != (n, rank):
        raise ValueError(f"{fn} needs y [T, {n}] and b [S, {n}, {rank}], got "
                         f"{tuple(y.shape)} and {tuple(b.shape)}")
    if y.dtype not in _DTYPES or b.dtype != y.dtype:
        raise ValueError(f"y and b must share a float dtype, got {y.dtype} and {b.dtype}")
    if y.stride(1) != 1 or b.stride(2) != 1:
        raise ValueError(f"{fn} needs contiguous rows of y and b")
    return slice_sizes


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor, *, token_order: torch.Tensor | None = None,
                pdl: bool = False,
                _config: tuple[int, int, int, int, int] | None = None) -> None:
    """x [T, K] (fp16/bf16/fp32, rows may be strided), a [S, R, K] (x's dtype; rows of each
    slot contiguous), token_slots [T] int32 (each token's slot, -1 = no adapter; not checked
    against S), out [T, R] float32 with contiguous rows, written in full: out[t] =
    a[slot[t]] @ x[t] accumulated in fp32, 0 where slot[t] = -1. `token_order` [T] int32: a
    permutation of range(T) grouping the tokens by slot (LoRABatch.token_order), which the
    block variant follows (the per-token one needs none). `pdl`: launch with programmatic
    dependent launch where the GPU has it (kernels/_common; the slot maps and A are read
    before the wait). `_config` (tests, tuning) forces (BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K,
    num_warps); BLOCK_M is 1 or >= 16."""
    require_triton()
    _check_shrink_side("lora_shrink", x, a)
    t, k = x.shape
    r = a.shape[1]
    _check_map("token_slots", token_slots, t)
    if token_order is not None:
        _check_map("token_order", token_order, t)
    if out.shape != (t, r) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{t}, {r}] with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if t == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_r, block_k, split, warps = \
        _config or _shrink_tiles(t, r, k, _block_m(t, token_order is not None))
    grid = (triton.cdiv(t, block_m), triton.cdiv(r, block_r), split)
    if split > 1 and grid[0] * grid[1] > _COUNTERS:
        raise ValueError(f"a split shrink takes at most {_COUNTERS} tiles, got {grid[:2]}")
    # fp32 partials of a split: allocated per call (a CUDA graph keeps its own)
    partials = torch.empty((split, t, r), dtype=torch.float32, device=x.device) \
        if split > 1 else out
    ordered = token_order is not None and block_m > 1
    pdl = pdl_launch(x, pdl)
    _shrink_kernel[grid](
        x, a, token_slots, token_order if ordered else token_slots, out, partials,
        _split_counters(x.device), t, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        R=r, K=k,
        # fp32 stays exact in tl.dot (its default there is tf32)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split, ORDERED=ordered,
        USE_PDL=pdl, num_warps=warps, num_stages=1 if INTERPRET else 3, launch_pdl=pdl)


def _u_mode(buf_dtype: torch.dtype, y_dtype: torch.dtype) -> int:
    """How the expand's blocks multiply: 1 splits an fp32 u into two bf16 terms (bf16 y),
    2 takes a 16-bit u as it is, 0 multiplies in fp32 at the kernel's PRECISION."""
    if buf_dtype == torch.float32:
        return 1 if y_dtype == torch.bfloat16 else 0
    return 2


def lora_expand(buf: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                slice_sizes: tuple[int, ...], rank: int, *,
                token_order: torch.Tensor | None = None, pdl: bool = False,
                u_slot_stride: int = 0,
                _config: tuple[int, int, int] | None = None) -> None:
    """buf [T, n_slices * rank] float32 (lora_shrink's out), b [S, N, rank] (N =
    sum(slice_sizes), y's dtype, rank contiguous), y [T, N] with contiguous rows, updated in
    place: for each slice j with output rows [off_j, off_j + size_j),
    y[t, off_j:off_j + size_j] += b[slot[t], off_j:off_j + size_j, :] @ buf[t, j*rank:(j+1)*rank]
    with the product in fp32 (bf16 blocks: buf carried to 16 significant bits, b exact;
    fp16: tf32x3), added to y in fp32 and rounded once to y's dtype; tokens with
    slot -1 are left untouched. `token_order` and `pdl` as in lora_shrink (B is read before
    the wait); `_config` (tests, tuning) forces (BLOCK_M, BLOCK_N, num_warps).

    `u_slot_stride` > 0: buf holds every slot's shrink side by side (a dense x @ A_all^T of
    all slots, e.g. from one GEMM with the base weight), and token t reads its columns
    from slot[t] * u_slot_stride on: buf [T, >= (S - 1) * u_slot_stride + n_slices * rank].
    buf may then also be in y's 16-bit dtype (the GEMM's output), used as it is."""
    require_triton()
    slice_sizes = _check_expand_side("lora_expand", b, y, slice_sizes, rank)
    t = y.shape[0]
    width = len(slice_sizes) * rank
    if u_slot_stride < 0 or (u_slot_stride and u_slot_stride < width):
        raise ValueError(f"u_slot_stride must be 0 or at least {width}, got {u_slot_stride}")
    need = (b.shape[0] - 1) * u_slot_stride + width
    dtypes = (torch.float32, y.dtype) if u_slot_stride else (torch.float32,)
    if buf.dim() != 2 or buf.shape[0] != t or buf.dtype not in dtypes or buf.stride(1) != 1 \
            or (buf.shape[1] != width if not u_slot_stride else buf.shape[1] < need):
        raise ValueError(f"buf must be {' or '.join(map(str, dtypes))} [{t}, "
                         f"{width if not u_slot_stride else f'>= {need}'}] with contiguous "
                         f"rows, got {tuple(buf.shape)} {buf.dtype}")
    _check_map("token_slots", token_slots, t)
    if token_order is not None:
        _check_map("token_order", token_order, t)
    if t == 0:
        return
    block_m, block_n, warps = _config or _expand_tiles(
        t, rank, min(32, _block_m(t, token_order is not None)))
    # tl.dot takes at least 16 along the rank
    rank_pad = next_pow2(rank) if block_m == 1 else max(16, next_pow2(rank))
    ordered = token_order is not None and block_m > 1
    pdl = pdl_launch(y, pdl)
    grid = (triton.cdiv(t, block_m), triton.cdiv(max(slice_sizes), block_n), len(slice_sizes))
    _expand_kernel[grid](
        buf, b, token_slots, token_order if ordered else token_slots, y, t, buf.stride(0),
        b.stride(0), b.stride(1), y.stride(0), SLICES=slice_sizes, RANK=rank,
        # fp32 stays exact; for 16-bit weights tf32x3 keeps the fp32 buf's precision
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",
        BLOCK_M=block_m, BLOCK_N=block_n, RANK_PAD=rank_pad,
        U_SLOT_STRIDE=u_slot_stride, U_MODE=_u_mode(buf.dtype, y.dtype),
        ORDERED=ordered, USE_PDL=pdl,
        num_warps=warps, num_stages=1, launch_pdl=pdl)


def lora_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, y: torch.Tensor,
                       slice_sizes: tuple[int, ...], rank: int, *, pdl: bool = False,
                       _config: tuple[int, int, int, int] | None = None) -> None:
    """lora_shrink then lora_expand in one launch, for a few tokens (the projections use it
    up to FUSED_MAX_T; it is correct at any T, but redoes each token's shrink once per
    column tile). x [T, K] and a [S, n_slices * rank, K] as in lora_shrink, b, y,
    slice_sizes and rank as in lora_expand, all of one dtype: y[t, slice j] +=
    b[slot[t]][slice j rows] @ (a[slot[t]][j*rank:(j+1)*rank] @ x[t]), both products in
    fp32, added to y in fp32 and rounded once; tokens with slot -1 are left untouched. `pdl`
    as in lora_shrink (the slot, B and A's first tile are read before the wait); `_config`
    (tests, tuning) forces (BLOCK_N, BLOCK_K, SPLIT_K, num_warps)."""
    require_triton()
    _check_shrink_side("lora_shrink_expand", x, a)
    slice_sizes = _check_expand_side("lora_shrink_expand", b, y, slice_sizes, rank)
    t, k = x.shape
    if a.shape[1] != len(slice_sizes) * rank or y.shape[0] != t or y.dtype != x.dtype:
        raise ValueError(f"lora_shrink_expand needs a [S, {len(slice_sizes) * rank}, K] and "
                         f"y [{t}, N] of x's dtype, got {tuple(a.shape)} and "
                         f"{tuple(y.shape)} {y.dtype}")
    _check_map("token_slots", token_slots, t)
    if t == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n, block_k, split, warps = _config or _fused_tiles(k, rank)
    tiles = sum(triton.cdiv(s, block_n) for s in slice_sizes)
    if split > 1 and t * tiles > _COUNTERS:
        raise ValueError(f"a split lora_shrink_expand takes at most {_COUNTERS} (token, "
                         f"tile) pairs, got {t} x {tiles}")
    rank_pad = next_pow2(rank)
    # fp32 partial shrinks of a split, per (token, tile): allocated per call, as lora_shrink's
    partials = torch.empty((split, t, tiles, rank_pad), dtype=torch.float32,
                           device=x.device) if split > 1 else y
    pdl = pdl_launch(y, pdl)
    _fused_kernel[(t, tiles, split)](
        x, a, b, token_slots, y, partials, _split_counters(x.device), t, x.stride(0),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0),
        SLICES=slice_sizes, RANK=rank, K=k, RANK_PAD=rank_pad, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split, USE_PDL=pdl,
        num_warps=warps, num_stages=1 if INTERPRET else 3, launch_pdl=pdl)
