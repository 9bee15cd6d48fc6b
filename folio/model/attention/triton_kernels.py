"""Triton kernels for paged attention, with thin Python launchers.

Three launchers:
  * `reshape_and_cache`: scatter this step's K/V rows into the paged cache by slot.
  * `paged_attention_varlen`: one launch for a whole mixed batch (fresh prefills, prefills over a
    cached prefix, chunked prefills, decodes). Grid = (query tiles of all requests, KV heads).
  * `paged_attention_decode`: one query token per request, split-K along the context
    (flash-decoding) so that a few long sequences still fill the GPU; the last split of each
    (request, KV head) to finish merges them (a second small kernel where the merge would not
    fit the decode kernel's registers, or the batch has too many such pairs).

Layouts: query/out [T, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables
[B, max_blocks] int32; query_start_loc [B+1] int32; seq_lens [B] int32 (context after this step).

GQA: the G = H // KVH query heads sharing a KV head are folded into the rows of one query tile
(row = token * G_PAD + head), so each K/V tile is loaded once per KV head, not once per head.

Softmax runs in the log2 domain (exp2 with scale * log2(e) folded into the scores) in fp32.

FP8 cache (--kv-cache-dtype fp8, folio/model/attention/fp8.py): it holds K / k_scale and
V / v_scale, one float32 scale per KV head. The cache write divides, clamps to the format's
largest value and casts; the attention kernels load the float8 tile, convert it to the query's
dtype (exact: every e4m3 and e5m2 value is a float16 and a bfloat16) and keep the scales out
of the tiles (the decode kernel, and the varlen kernel's tiles under 64 rows, read the cache
as int16 pairs of elements, `_attend_tile`'s PAIRS, so that their tiles take the 16-bit path
through shared memory): a program serves one KV head, so k_scale folds into the score scale
and v_scale into the output (the split-K partials), one multiply per program instead of one
per element.
The scales are read from their tensors, so a captured CUDA graph sees the values they hold.

Soft cap (Gemma 2) and attention sinks (GPT-OSS), both optional and compiled in only when
used (SOFTCAP, HAS_SINKS). The cap works in the log2 domain unchanged: with s2 = s * log2(e)
and cap2 = cap * log2(e), cap2 * tanh(s2 / cap2) = log2(e) * cap * tanh(s / cap). tanh is
written with exp2 (1 - 2 / (e^2x + 1)), which Triton's interpreter and every GPU have. A
sink is a key of logit `sink` with a zero value: the online softmax starts from it (m = sink
* log2(e), l = 1) instead of (-inf, 0). In split-K decode only split 0 starts from it, so
the merge counts it once.

Importing this module needs no GPU: `triton.jit` only records the function; compilation happens
at the first launch. Autotuning is cut to one config under TRITON_INTERPRET=1 (read at import)
so the CPU interpreter runs each kernel once.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from folio.model.attention.fp8 import fp8_max, is_fp8, per_head_scales
from folio.model.kernels._common import HAS_TRITON, INTERPRET, pdl_launch, tl, triton  # noqa: F401
from folio.model.kernels._common import next_pow2 as _next_pow2

if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import pdl_entry

_LOG2E = 1.4426950408889634


def _configs(interpret_one: dict, full: list[tuple[dict, int, int]]) -> list:
    """Autotune configs: the single `interpret_one` under the interpreter, else `full`
    as (kwargs, num_warps, num_stages)."""
    if INTERPRET:
        return [triton.Config(interpret_one, num_warps=4, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in full]


# Shared memory a config may plan for (the H200 has 227 KiB a block; some left to Triton).
_SMEM_BUDGET = 200 << 10
# Head dims above this (MLA's latent + rope: 576, padded to 1024) take the small configs only.
_WIDE_D_PAD = 256


def _smem_bytes(config: Any, rows: int, d_pad: int, elem: int) -> int:
    """A config's shared memory, roughly: the query tile, and K and V tiles per stage."""
    return elem * d_pad * (rows + 2 * config.kwargs["BLOCK_N"] * max(1, config.num_stages))


def _fit_head_dim(configs: list, args: dict, rows_of: Any) -> list:
    """The configs whose tiles fit shared memory at this head dim. The small single-stage
    ones exist for wide heads (MLA: 576) and are dropped for the usual ones, which keep the
    tuned set; none fitting keeps the smallest (the compiler then says why)."""
    d_pad, elem = args["D_PAD"], args["Q"].element_size()
    wide = d_pad > _WIDE_D_PAD
    kept = [c for c in configs
            if _smem_bytes(c, rows_of(c), d_pad, elem) <= _SMEM_BUDGET
            and (wide or c.num_stages > 1)]
    return kept or [min(configs, key=lambda c: _smem_bytes(c, rows_of(c), d_pad, elem))]


def _prune_varlen(configs: list, named_args: dict, **kwargs) -> list:
    """Drop varlen configs whose BLOCK_M cannot hold one token's G_PAD query heads, then
    those that do not fit shared memory at this head dim."""
    args = {**named_args, **kwargs}
    g_pad = args["G_PAD"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] >= g_pad]
    kept = kept or [max(configs, key=lambda c: c.kwargs["BLOCK_M"])]
    return _fit_head_dim(kept, args, lambda c: c.kwargs["BLOCK_M"])


def _prune_decode(configs: list, named_args: dict, **kwargs) -> list:
    """Decode configs that fit shared memory (the query tile: G_M rows)."""
    args = {**named_args, **kwargs}
    return _fit_head_dim(configs, args, lambda c: args["G_M"])


def _dot_precision(dtype: torch.dtype) -> str:
    # Triton's default fp32 dot is tf32 (~3e-4 relative error); keep fp32 exact so fp32 runs
    # can serve as a tight check. 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


if HAS_TRITON:

    # ------------------------------------------------------------------ reshape_and_cache
    @autotune(
        configs=_configs({}, [({}, 1, 1), ({}, 2, 1), ({}, 4, 1)]),
        key=["KVH_PAD", "D_PAD"],
    )
    @triton.jit
    def _reshape_and_cache_kernel(
        K, V, KV, SLOTS, K_SCALE, V_SCALE,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_c0, stride_cblk, stride_coff, stride_ch,
        KVH: tl.constexpr, D: tl.constexpr, KVH_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_entry(USE_PDL)
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot < 0:  # padding token: nothing to write
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, KVH_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < KVH) & (d[None, :] < D)
        t64 = t.to(tl.int64)
        k = tl.load(K + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(V + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if FP8:
            # x / scale by IEEE division (the torch reference's bytes), clamped before the cast.
            ks = tl.load(K_SCALE + h, mask=h < KVH, other=1.0)[:, None]
            vs = tl.load(V_SCALE + h, mask=h < KVH, other=1.0)[:, None]
            k = tl.math.div_rn(k.to(tl.float32), tl.broadcast_to(ks, (KVH_PAD, D_PAD)))
            v = tl.math.div_rn(v.to(tl.float32), tl.broadcast_to(vs, (KVH_PAD, D_PAD)))
            k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        dst = KV + blk * stride_cblk + off * stride_coff + h[:, None] * stride_ch + d[None, :]
        tl.store(dst, k.to(KV.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c0, v.to(KV.dtype.element_ty), mask=mask)

    # ------------------------------------------------------------------ shared tile step
    @triton.jit
    def _tanh(x):
        # 1 - 2 / (e^2x + 1): exact limits (e^2x overflows to inf -> 1, underflows to 0 -> -1)
        return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)

    @triton.jit
    def _sink_logits(SINKS, heads, ok):
        """The rows' sink logits in the log2 domain (sink * log2(e)); 0 where not `ok`."""
        return tl.load(SINKS + heads, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634

    @triton.jit
    def _fp8_pairs(x, CVT_ASM: tl.constexpr, E5M2: tl.constexpr):
        """A tile of an FP8 cache read as int16 pairs (element 2i in the low byte, 2i + 1 in
        the high) -> (float16 of the even elements, of the odd), exact. CVT_ASM: one
        conversion instruction per pair (sm_89+); else each byte apart (the interpreter; a GPU
        before sm_89 compiles no e4m3 conversion either way)."""
        x = x.to(tl.uint16, bitcast=True)
        if E5M2:  # an e5m2 value is the high byte of the float16 of the same value
            return (x << 8).to(tl.float16, bitcast=True), (x & 0xFF00).to(tl.float16,
                                                                          bitcast=True)
        if CVT_ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
                "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi

    @triton.jit
    def _tile_rows(BT_row, k_pos, kv_end, kvh, stride_cblk, stride_coff, stride_ch,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
        """The cache offsets of keys `k_pos` [N] of KV head `kvh` (a page lookup per key: a
        tile may span several pages, or part of one), and which of them are in the context
        (all, unless MASKED)."""
        if MASKED:
            in_ctx = k_pos < kv_end
            page = tl.load(BT_row + k_pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        else:
            in_ctx = k_pos >= 0
            page = tl.load(BT_row + k_pos // BLOCK_SIZE).to(tl.int64)
        return page * stride_cblk + (k_pos % BLOCK_SIZE) * stride_coff + kvh * stride_ch, in_ctx

    @triton.jit
    def _online_softmax(s, m_i, l_i, k_pos, in_ctx, q_pos, window, soft_cap,
                        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
        """One online-softmax step over scores s [M, N] (log2 domain, scaled): keys outside
        the context, after the query (causal) or outside the window masked. Returns the
        tile's weights p, the factor alpha for what came before, and the new (m, l)."""
        if SOFTCAP:  # soft_cap = cap * log2(e): see the module's docstring
            s = soft_cap * _tanh(s / soft_cap)
        if MASKED:
            visible = in_ctx[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # Rows with nothing visible yet keep m = -inf; shift by 0 there so exp2 gives 0,
            # not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _attend_tile(
        q, q2, acc, acc2, m_i, l_i, KV, BT_row, k_pos, kv_end, q_pos, kvh, window, qk_scale,
        soft_cap, stride_c0, stride_cblk, stride_coff, stride_ch,
        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SLIDING: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr,
        PAIRS: tl.constexpr, CVT_ASM: tl.constexpr, E5M2: tl.constexpr,
        MASKED: tl.constexpr = True,
    ):
        """One online-softmax step of a query tile [M, D_PAD] over keys `k_pos` [N].
        Keys past `kv_end`, after the query (causal) or outside the window are masked. K/V
        tiles are used in the query's dtype (an FP8 cache's converted; its scales are the
        caller's). MASKED=False is for tiles every row sees in full (keys in the context,
        before every query, no window): no masks, and no row left at -inf.

        PAIRS (an FP8 cache, `_read_mode`): the tiles are read as int16 pairs of elements
        (through an int16 pointer to the same bytes; offsets halved) and widened into even and
        odd halves. q / acc hold the query's and the output's even head-dim elements, q2 /
        acc2 the odd ([M, D_PAD / 2] each), and q.k = q_even.k_even + q_odd.k_odd. A float8
        tile read for a transposed register product went through shared memory a byte at a
        time (the decode kernel read an FP8 cache at 72 % of its bf16 bytes' rate); 16-bit
        pairs take the 16-bit path (ldmatrix), as a bf16 tile does. Otherwise q2 and acc2 are
        passed through untouched (the non-pair code is the kernels' code before pairs)."""
        row, in_ctx = _tile_rows(BT_row, k_pos, kv_end, kvh, stride_cblk, stride_coff,
                                 stride_ch, BLOCK_SIZE, MASKED)
        if PAIRS:
            e = tl.arange(0, D_PAD // 2)
            kv_mask = in_ctx[:, None] & (e[None, :] < D // 2)
            KV16 = KV.to(tl.pointer_type(tl.int16), bitcast=True)
            ptr = KV16 + (row // 2)[:, None] + e[None, :]
            k_e, k_o = _fp8_pairs(tl.load(ptr, mask=kv_mask, other=0), CVT_ASM, E5M2)
            s = (tl.dot(q, tl.trans(k_e.to(q.dtype)), input_precision=DOT_PREC)
                 + tl.dot(q2, tl.trans(k_o.to(q.dtype)), input_precision=DOT_PREC))
        else:
            d = tl.arange(0, D_PAD)
            kv_mask = in_ctx[:, None] & (d[None, :] < D)
            ptr = KV + row[:, None] + d[None, :]
            k = tl.load(ptr, mask=kv_mask, other=0.0).to(q.dtype)             # [N, D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)              # [M, N] fp32
        p, alpha, m_new, l_i = _online_softmax(s * qk_scale, m_i, l_i, k_pos, in_ctx, q_pos,
                                               window, soft_cap, SLIDING, SOFTCAP, MASKED)
        if PAIRS:
            v_e, v_o = _fp8_pairs(tl.load(ptr + stride_c0 // 2, mask=kv_mask, other=0),
                                  CVT_ASM, E5M2)
            p = p.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p, v_e.to(q.dtype), input_precision=DOT_PREC)
            acc2 = acc2 * alpha[:, None] + tl.dot(p, v_o.to(q.dtype), input_precision=DOT_PREC)
        else:
            v = tl.load(KV + stride_c0 + row[:, None] + d[None, :], mask=kv_mask,
                        other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return acc, acc2, m_new, l_i

    @triton.jit
    def _load_query(Q, q_rows, heads, stride_qt, stride_qh, row_ok, D: tl.constexpr,
                    D_PAD: tl.constexpr, FP8: tl.constexpr, PAIRS: tl.constexpr):
        """A query tile [M, D_PAD] (rows q_rows x heads), or with PAIRS its even and odd
        head-dim elements [M, D_PAD / 2] each; for an FP8 cache in float16 where the query is
        bf16. Returns (q, q2), q2 = q without PAIRS."""
        base = Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
        if PAIRS:
            e = tl.arange(0, D_PAD // 2)
            mask = row_ok[:, None] & (e[None, :] < D // 2)
            q = tl.load(base + 2 * e[None, :], mask=mask, other=0.0)
            q2 = tl.load(base + 2 * e[None, :] + 1, mask=mask, other=0.0)
        else:
            d = tl.arange(0, D_PAD)
            q = tl.load(base + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            q2 = q
        if FP8 and Q.dtype.element_ty == tl.bfloat16:
            # FP8 K/V tiles widen to fp16 in one instruction per pair (e4m3x2 -> f16x2) where
            # bf16 takes several; every FP8 value is exact in fp16, and queries sit far inside
            # its range. The measured decode kernel was 33 % slower on an FP8 cache than on
            # a bf16 one, from the conversions alone (docs/benchmarks.md).
            q = q.to(tl.float16)
            if PAIRS:
                q2 = q2.to(tl.float16)
            else:
                q2 = q
        return q, q2

    @triton.jit
    def _store_rows(ptr, acc, acc2, row_ok, NCOLS: tl.constexpr, D_PAD: tl.constexpr,
                    PAIRS: tl.constexpr):
        """Store the first NCOLS columns of acc [M, D_PAD] at ptr [M, 1] + column, rows where
        row_ok; with PAIRS acc [M, D_PAD / 2] holds the even columns and acc2 the odd."""
        if PAIRS:
            e = tl.arange(0, D_PAD // 2)
            mask = row_ok[:, None] & (e[None, :] < NCOLS // 2)
            tl.store(ptr + 2 * e[None, :], acc, mask=mask)
            tl.store(ptr + 2 * e[None, :] + 1, acc2, mask=mask)
        else:
            d = tl.arange(0, D_PAD)
            tl.store(ptr + d[None, :], acc, mask=row_ok[:, None] & (d[None, :] < NCOLS))

    # ------------------------------------------------------------------ varlen (mixed batch)
    @autotune(
        configs=_configs(
            {"BLOCK_M": 16, "BLOCK_N": 16},
            [({"BLOCK_M": bm, "BLOCK_N": bn}, w, s)
             for bm, bn, w, s in [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                                  (128, 32, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                                  (32, 64, 4, 2),
                                  # wide heads only (_fit_head_dim)
                                  (16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1),
                                  (64, 16, 8, 1)]],
        ),
        key=["G", "D", "BLOCK_SIZE", "SLIDING", "q_bucket", "SOFTCAP", "HAS_SINKS"],
        prune_configs_by={"early_config_prune": _prune_varlen},
    )
    # Per-step integers are not specialized on (== 1, % 16): each distinct pattern would be
    # another compile, paid in the middle of serving.
    @triton.jit(do_not_specialize=["stride_bt", "num_reqs", "window", "q_bucket"])
    def _varlen_kernel(
        Q, KV, O, QSL, SEQ, BT, K_SCALE, V_SCALE, SINKS, SKIP,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_c0, stride_cblk, stride_coff, stride_ch, stride_bt,
        num_reqs, window, qk_scale, soft_cap, q_bucket,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
        FP8: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        HAS_SKIP: tl.constexpr, PAIRS: tl.constexpr, CVT_ASM: tl.constexpr,
        E5M2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD  # query tokens per tile
        # The decode kernel's pairs (PAIRS) for tiles under 64 rows only: those take register
        # products, which read a float8 K tile a byte at a time as the decode kernel's did;
        # the larger tiles take Hopper's shared-memory products, for which pairs slowed an 8k
        # prefill over an FP8 cache 1.6x (docs/benchmarks.md, session 30).
        TILE_PAIRS: tl.constexpr = PAIRS and BLOCK_M < 64
        # Last tiles first: a request's later tiles see more keys, and starting the longest
        # programs first leaves short ones, not long ones, for the last wave.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        # Request b owns tiles [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1): an upper
        # bound on its tile count that needs no per-step host prefix sum. Binary search for the
        # last b whose first tile is <= pid.
        lo = tl.full((), 0, tl.int32)
        hi = tl.full((), 0, tl.int32) + num_reqs
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            first = tl.load(QSL + mid) // BLOCK_Q + mid
            go_right = first <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        b = lo
        if HAS_SKIP:  # a request whose attention another kernel computes (dense_prefill.py)
            if tl.load(SKIP + b) != 0:
                return
        q_start = tl.load(QSL + b)
        q_len = tl.load(QSL + b + 1) - q_start
        tile = pid - (q_start // BLOCK_Q + b)
        if tile * BLOCK_Q >= q_len:  # slack tile of the upper bound
            return
        seq_len = tl.load(SEQ + b)
        ctx_off = seq_len - q_len  # absolute position of the request's first query token
        if FP8:  # scores of the stored K / k_scale, times k_scale
            qk_scale = qk_scale * tl.load(K_SCALE + kvh)

        offs_m = tl.arange(0, BLOCK_M)
        tok = tile * BLOCK_Q + offs_m // G_PAD
        hd = offs_m % G_PAD
        row_ok = (tok < q_len) & (hd < G)
        q_rows = (q_start + tok).to(tl.int64)
        heads = kvh * G + hd
        q, q2 = _load_query(Q, q_rows, heads, stride_qt, stride_qh, row_ok, D, D_PAD, FP8,
                            TILE_PAIRS)
        q_pos = ctx_off + tok

        last_tok = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = ctx_off + last_tok + 1  # causal: nothing past the tile's last query
        kv_start = 0
        if SLIDING:
            kv_start = tl.maximum(ctx_off + tile * BLOCK_Q - window + 1, 0)
            kv_start = (kv_start // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink as a first key: logit sink, weight exp2(0) = 1, no value
            m_i = _sink_logits(SINKS, heads, row_ok)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD // 2 if TILE_PAIRS else D_PAD], tl.float32)
        # the odd half with pairs; else a placeholder _attend_tile passes through
        acc2 = tl.zeros([BLOCK_M, D_PAD // 2 if TILE_PAIRS else 16], tl.float32)
        BT_row = BT + b.to(tl.int64) * stride_bt
        masked_start = kv_start
        if not SLIDING:
            # Keys up to the tile's first query are visible to all its rows: whole BLOCK_N
            # tiles of them skip the masks (a long prefill's tiles are nearly all such).
            masked_start = ((ctx_off + tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
            for start in range(0, masked_start, BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)
                acc, acc2, m_i, l_i = _attend_tile(
                    q, q2, acc, acc2, m_i, l_i, KV, BT_row, k_pos, kv_end, q_pos, kvh, window,
                    qk_scale, soft_cap, stride_c0, stride_cblk, stride_coff, stride_ch,
                    D, D_PAD, BLOCK_SIZE, SLIDING, DOT_PREC, SOFTCAP, TILE_PAIRS, CVT_ASM,
                    E5M2, MASKED=False)
        for start in range(masked_start, kv_end, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            acc, acc2, m_i, l_i = _attend_tile(
                q, q2, acc, acc2, m_i, l_i, KV, BT_row, k_pos, kv_end, q_pos, kvh, window,
                qk_scale, soft_cap, stride_c0, stride_cblk, stride_coff, stride_ch,
                D, D_PAD, BLOCK_SIZE, SLIDING, DOT_PREC, SOFTCAP, TILE_PAIRS, CVT_ASM, E5M2)

        if FP8:  # the weighted sum of the stored V / v_scale, times v_scale
            acc = acc * tl.load(V_SCALE + kvh)
            acc2 = acc2 * tl.load(V_SCALE + kvh)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = O + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
        _store_rows(o_ptr, (acc / l_safe).to(O.dtype.element_ty),
                    (acc2 / l_safe).to(O.dtype.element_ty), row_ok, D, D_PAD, TILE_PAIRS)

    # ------------------------------------------------------------------ decode (split-K)
    @autotune(
        configs=_configs(
            {"BLOCK_N": 16},
            [({"BLOCK_N": bn}, w, s)
             for bn, w, s in [(32, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3),
                              # wide heads only (_fit_head_dim)
                              (16, 4, 1), (32, 4, 1), (32, 8, 1)]],
        ),
        key=["G", "D", "BLOCK_SIZE", "SLIDING", "USE_SPLITS", "SOFTCAP", "HAS_SINKS"],
        prune_configs_by={"early_config_prune": _prune_decode},
    )
    @triton.jit(do_not_specialize=["stride_bt", "num_splits", "window"])
    def _decode_kernel(
        Q, KV, O, M_PART, L_PART, ACC_PART, CNT, SEQ, BT, K_SCALE, V_SCALE, SINKS,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_c0, stride_cblk, stride_coff, stride_ch, stride_bt,
        num_splits, window, qk_scale, soft_cap,
        G: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
        FP8: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        USE_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr, G_P: tl.constexpr,
        S_CHUNK: tl.constexpr, USE_PDL: tl.constexpr, PAIRS: tl.constexpr,
        CVT_ASM: tl.constexpr, E5M2: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pdl_entry(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ + b)
        if FP8:  # scores of the stored K / k_scale, times k_scale
            qk_scale = qk_scale * tl.load(K_SCALE + kvh)
        # Rows = the G query heads of this KV head, padded to G_M >= 16 for tl.dot; the pad rows
        # are masked on load and store, so they cost registers, not memory traffic.
        hd = tl.arange(0, G_M)
        heads = kvh * G + hd
        h_ok = hd < G
        b64 = b.to(tl.int64)
        q, q2 = _load_query(Q, tl.zeros([G_M], tl.int64) + b64, heads, stride_qt, stride_qh,
                            h_ok, D, D_PAD, FP8, PAIRS)
        q_pos = tl.zeros([G_M], tl.int32) + (seq_len - 1)

        kv_lo = 0
        if SLIDING:
            kv_lo = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N
        # Each split takes a contiguous run of whole tiles of this request's (visible) context.
        num_tiles = tl.cdiv(seq_len - kv_lo, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        start = kv_lo + split * tiles_per_split * BLOCK_N
        end = tl.minimum(seq_len, start + tiles_per_split * BLOCK_N)

        m_i = tl.full([G_M], float("-inf"), tl.float32)
        l_i = tl.zeros([G_M], tl.float32)
        if HAS_SINKS:  # split 0 only: the merge adds the splits' denominators
            first = split == 0
            m_i = tl.where(first, _sink_logits(SINKS, heads, h_ok), m_i)
            l_i = tl.where(first, 1.0, l_i)
        acc = tl.zeros([G_M, D_PAD // 2 if PAIRS else D_PAD], tl.float32)
        # the odd half with pairs; else a placeholder _attend_tile passes through
        acc2 = tl.zeros([G_M, D_PAD // 2 if PAIRS else 16], tl.float32)
        BT_row = BT + b64 * stride_bt
        masked_start = start
        if not SLIDING:
            # Every key before `end` is visible to the one query: only a last partial tile
            # needs masks.
            masked_start = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
            for s0 in range(start, masked_start, BLOCK_N):
                k_pos = s0 + tl.arange(0, BLOCK_N)
                acc, acc2, m_i, l_i = _attend_tile(
                    q, q2, acc, acc2, m_i, l_i, KV, BT_row, k_pos, end, q_pos, kvh, window,
                    qk_scale, soft_cap, stride_c0, stride_cblk, stride_coff, stride_ch,
                    D, D_PAD, BLOCK_SIZE, SLIDING, DOT_PREC, SOFTCAP, PAIRS, CVT_ASM, E5M2,
                    MASKED=False)
        for s0 in range(masked_start, end, BLOCK_N):
            k_pos = s0 + tl.arange(0, BLOCK_N)
            acc, acc2, m_i, l_i = _attend_tile(
                q, q2, acc, acc2, m_i, l_i, KV, BT_row, k_pos, end, q_pos, kvh, window,
                qk_scale, soft_cap, stride_c0, stride_cblk, stride_coff, stride_ch,
                D, D_PAD, BLOCK_SIZE, SLIDING, DOT_PREC, SOFTCAP, PAIRS, CVT_ASM, E5M2)

        if FP8:  # the weighted sum of the stored V / v_scale, times v_scale (before the merge)
            acc = acc * tl.load(V_SCALE + kvh)
            acc2 = acc2 * tl.load(V_SCALE + kvh)
        if USE_SPLITS:
            # Partials [B, H, S] (m, l) and [B, H, S, D_PAD] (unnormalized acc); an empty split
            # writes m = -inf, l = 0, acc = 0, which the merge weighs as 0.
            part = (b64 * (G * tl.num_programs(1)) + heads) * num_splits + split
            tl.store(M_PART + part, m_i, mask=h_ok)
            tl.store(L_PART + part, l_i, mask=h_ok)
            _store_rows(ACC_PART + part[:, None] * D_PAD, acc, acc2, h_ok, D_PAD, D_PAD, PAIRS)
            if FUSED_MERGE:
                # The last split of this (request, KV head) to finish merges all of them:
                # one launch fewer per layer than a merge kernel (at batch 1 a decode graph
                # splits for its longest context, so every step had both). The ticket only
                # counts; the partials are read in split order, so the sum is the same
                # whichever split comes last.
                tl.debug_barrier()   # every thread's partial is written before the ticket
                cnt = CNT + b64 * tl.num_programs(1) + kvh
                ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
                if ticket == num_splits - 1:
                    _merge_splits(O, M_PART, L_PART, ACC_PART, b64, kvh, G * tl.num_programs(1),
                                  num_splits, stride_ot, stride_oh, G, G_P, D, D_PAD, S_CHUNK)
                    tl.store(cnt, 0)
        else:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            _store_rows(O + b64 * stride_ot + heads[:, None] * stride_oh,
                        (acc / l_safe).to(O.dtype.element_ty),
                        (acc2 / l_safe).to(O.dtype.element_ty), h_ok, D, D_PAD, PAIRS)

    @triton.jit
    def _merge_splits(O, M_PART, L_PART, ACC_PART, b64, kvh, num_heads, num_splits,
                      stride_ot, stride_oh, G: tl.constexpr, G_P: tl.constexpr,
                      D: tl.constexpr, D_PAD: tl.constexpr, S_CHUNK: tl.constexpr):
        """The G query heads of KV head `kvh` of request b64: their num_splits partials
        merged into O, S_CHUNK splits a load (a [S_CHUNK, G_P, D_PAD] block kept small, so
        the decode kernel's registers do not grow for it), rescaled online as the running
        maximum rises. Split order is fixed, so the result does not depend on which split
        came last. The partials are read from L2 (.cg): other programs wrote them."""
        g = tl.arange(0, G_P)
        d = tl.arange(0, D_PAD)
        heads = kvh * G + g
        h_ok = g < G
        row = (b64 * num_heads + heads) * num_splits     # [G_P]
        m_run = tl.full([G_P], float("-inf"), tl.float32)
        num = tl.zeros([G_P, D_PAD], tl.float32)
        den = tl.zeros([G_P], tl.float32)
        for s0 in range(0, num_splits, S_CHUNK):
            sp = s0 + tl.arange(0, S_CHUNK)
            part = row[None, :] + sp[:, None]                    # [S_CHUNK, G_P]
            ok = (sp[:, None] < num_splits) & h_ok[None, :]
            m = tl.load(M_PART + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l = tl.load(L_PART + part, mask=ok, other=0.0, cache_modifier=".cg")
            acc = tl.load(ACC_PART + part[:, :, None] * D_PAD + d[None, None, :],
                          mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m, 0))
            # -inf until a head has seen a key (empty splits, padding heads): weigh nothing
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.where(m_run == float("-inf"), 0.0, tl.math.exp2(m_run - m_ref))
            w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_ref[None, :]))
            num = num * alpha[:, None] + tl.sum(acc * w[:, :, None], 0)
            den = den * alpha + tl.sum(l * w, 0)
            m_run = m_new
        out = num / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(O + b64 * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=h_ok[:, None] & (d < D)[None, :])

    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_merge_kernel(
        O, M_PART, L_PART, ACC_PART, stride_ot, stride_oh, num_heads, num_splits,
        D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_entry(USE_PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        part = (b * num_heads + h) * num_splits + sp
        ok = sp < num_splits
        m = tl.load(M_PART + part, mask=ok, other=float("-inf"))
        l = tl.load(L_PART + part, mask=ok, other=0.0)
        acc = tl.load(ACC_PART + part[:, None] * D_PAD + d[None, :], mask=ok[:, None], other=0.0)
        m_max = tl.max(m, 0)  # finite: split 0 is never empty (it holds the first key)
        w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(O + b * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d < D)


# ---------------------------------------------------------------------- launchers
def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, nb, bs, KVH, D]"
    assert kv_cache.stride(4) == 1, "kv_cache head_dim must be contiguous"
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def kv_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(fp8, k_scale, v_scale) as the kernels take them: for an FP8 cache the [KVH] float32
    scales (None = 1.0); otherwise the cache stands in for the pointers, never read."""
    if not is_fp8(kv_cache.dtype):
        return False, kv_cache, kv_cache
    kvh = kv_cache.shape[3]
    return (True, per_head_scales(k_scale, kvh, kv_cache.device),
            per_head_scales(v_scale, kvh, kv_cache.device))


def _read_mode(kv_cache: torch.Tensor, d_pad: int) -> dict:
    """The attention kernels' read-mode constexprs for this cache: an FP8 cache of an even
    head dim (padded to >= 32, so that half of it still fills a product's 16-wide K) is read
    as int16 pairs (`_attend_tile`'s PAIRS), widened by the GPU's pair conversion where it has
    one (sm_89+; CVT_ASM) or byte by byte. The pairs' offsets are the cache's halved, so every
    stride and the start must be even (an engine's cache is contiguous; a view with odd
    strides reads float8 tiles)."""
    pairs = (is_fp8(kv_cache.dtype) and kv_cache.shape[4] % 2 == 0 and d_pad >= 32
             and all(st % 2 == 0 for st in kv_cache.stride()[:4])
             and kv_cache.data_ptr() % 2 == 0)
    e5m2 = pairs and kv_cache.dtype == torch.float8_e5m2
    cvt_asm = (pairs and not e5m2 and not INTERPRET and kv_cache.is_cuda
               and _has_fp8_cvt(kv_cache.device))
    return {"PAIRS": pairs, "CVT_ASM": cvt_asm, "E5M2": e5m2}


@functools.lru_cache(maxsize=None)
def _has_fp8_cvt(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, pdl: bool = False,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [T, KVH, D] into kv_cache at slot_mapping [T] (block * bs + offset);
    slots < 0 are padding and skipped. Casts to the cache dtype; an FP8 cache gets
    key / k_scale and value / v_scale ([KVH] float32 or one element; None = 1.0), clamped to
    the format's range. `pdl`: launch with programmatic dependent launch where the GPU has it
    (kernels/_common.py)."""
    _require_triton()
    T = key.shape[0]
    if T == 0:
        return
    kvh, d = key.shape[1], key.shape[2]
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert kv_cache.shape[3] == kvh and kv_cache.shape[4] == d
    s0, sblk, soff, sh = _cache_strides(kv_cache)
    fp8, k_scale, v_scale = kv_scales(kv_cache, k_scale, v_scale)
    pdl = pdl_launch(key, pdl)
    _reshape_and_cache_kernel[(T,)](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        s0, sblk, soff, sh,
        KVH=kvh, D=d, KVH_PAD=_next_pow2(kvh), D_PAD=_next_pow2(d),
        BLOCK_SIZE=kv_cache.shape[2], FP8=fp8,
        FP8_MAX=fp8_max(kv_cache.dtype) if fp8 else 0.0, USE_PDL=pdl, launch_pdl=pdl,
    )


def _soft_cap_and_sinks(query: torch.Tensor, logits_soft_cap: float | None,
                       sinks: torch.Tensor | None) -> tuple[bool, float, bool, torch.Tensor]:
    """(SOFTCAP, cap * log2(e), HAS_SINKS, sinks) as the kernels take them; without sinks the
    query stands in for the pointer, never read."""
    softcap = bool(logits_soft_cap)
    if sinks is None:
        return softcap, float(logits_soft_cap or 0.0) * _LOG2E, False, query
    assert sinks.dtype == torch.float32 and sinks.is_contiguous() and \
        sinks.numel() == query.shape[1], "sinks must be contiguous float32 [heads]"
    return softcap, float(logits_soft_cap or 0.0) * _LOG2E, True, sinks


def _check_query(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    assert query.dim() == 3 and query.stride(2) == 1, "query must be [T, H, D], D contiguous"
    num_heads, d = query.shape[1], query.shape[2]
    kvh = kv_cache.shape[3]
    assert kv_cache.shape[4] == d and num_heads % kvh == 0
    assert kv_cache.dtype == query.dtype or is_fp8(kv_cache.dtype), \
        "the cache must be in the query's dtype, or FP8"
    assert _next_pow2(kv_cache.shape[2]) == kv_cache.shape[2], "block_size must be a power of 2"
    return num_heads, kvh, d


def paged_attention_varlen(query: torch.Tensor, kv_cache: torch.Tensor, *,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                           scale: float, sliding_window: int | None = None,
                           out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           skip: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention for a mixed batch in one launch. query [T, H, D]; query i of
    request b sits at absolute position seq_lens[b] - q_len_b + i. An FP8 cache is read with
    its scales (reshape_and_cache). `logits_soft_cap`, `sinks` (float32 [H]): as
    AttentionBackend.forward. `skip` (int32 [B], nonzero = skip): requests whose rows of
    `out` are left as they are. Returns out [T, H, D]."""
    _require_triton()
    num_heads, kvh, d = _check_query(query, kv_cache)
    T = query.shape[0]
    if out is None:
        out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if T == 0 or num_reqs == 0:
        return out
    assert out.stride(2) == 1 and block_tables.stride(1) == 1
    g = num_heads // kvh
    g_pad = _next_pow2(g)
    assert g_pad <= 128, "more than 128 query heads per KV head is not supported"
    s0, sblk, soff, sh = _cache_strides(kv_cache)
    fp8, k_scale, v_scale = kv_scales(kv_cache, k_scale, v_scale)
    d_pad = max(16, _next_pow2(d))
    softcap, soft_cap, has_sinks, sinks = _soft_cap_and_sinks(query, logits_soft_cap, sinks)
    sliding = sliding_window is not None and sliding_window > 0
    # Autotune per coarse bucket of the longest query (decode-heavy / short chunks / long
    # prefills): a few buckets, so a server autotunes a few times, not at every new length.
    q_bucket = next(b for b in (16, 256, 1 << 30) if max_query_len <= b)

    def grid(meta: dict) -> tuple[int, int]:
        block_q = max(1, meta["BLOCK_M"] // g_pad)
        return (T // block_q + num_reqs, kvh)

    _varlen_kernel[grid](
        query, kv_cache, out, query_start_loc, seq_lens, block_tables, k_scale, v_scale, sinks,
        seq_lens if skip is None else skip,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        s0, sblk, soff, sh, block_tables.stride(0),
        num_reqs, sliding_window if sliding else 0, scale * _LOG2E, soft_cap, q_bucket,
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad,
        BLOCK_SIZE=kv_cache.shape[2], SLIDING=sliding, DOT_PREC=_dot_precision(query.dtype),
        FP8=fp8, SOFTCAP=softcap, HAS_SINKS=has_sinks, HAS_SKIP=skip is not None,
        **_read_mode(kv_cache, d_pad),
    )
    return out


# Ticket counters for the decode kernel's fused merge, one per (request, KV head) of a step,
# zero between launches (the last split of each resets its own); per device, made on first
# use (a warm-up step, before any graph is captured). Larger batches merge in a second kernel.
_MERGE_TICKETS = 16384
_merge_workspaces: dict = {}
# The fused merge reads S_CHUNK = _MERGE_BLOCK // (G_P * D_PAD) splits' partials a load
# (Llama-3-8B's 4 x 128 per KV head: 16, a batch-1 decode graph's splits in one load).
# Only the decode kernel's split variant carries it, which runs at small batches (few
# programs), so its registers matter less there; compiled for sm_90 here it took the
# 4-warp tiles from 96 to 154-168 registers (254 at G = 16), without spilling. Heads whose
# [G_P, D_PAD] passes _MERGE_HEADS (latent attention: 16-128 query heads of 576 dims on one
# KV head) merge in the second kernel: all of their splits at once passed Triton's largest
# tensor, and fewer spilled.
_MERGE_BLOCK = 8192
_MERGE_HEADS = 2048


def _merge_tickets(device: torch.device) -> torch.Tensor:
    from folio.model.kernels._common import split_k_workspace
    return split_k_workspace(_merge_workspaces, device, 1, _MERGE_TICKETS)[1]


def choose_num_splits(num_reqs: int, kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Flash-decoding split count: enough (request, KV head, split) programs for ~2 waves of
    the SMs, but no split shorter than `min_tokens_per_split` keys. A power of two, so the
    merge kernel compiles for few values."""
    want = math.ceil(2 * num_sms / max(1, num_reqs * kv_heads))
    by_len = max(1, max_seq_len // min_tokens_per_split)
    n = max(1, min(want, by_len, max_splits))
    return 1 << (n.bit_length() - 1)  # round down to a power of two


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float,
                           sliding_window: int | None = None, num_splits: int = 1,
                           out: torch.Tensor | None = None, pdl: bool = False,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           _config: dict | None = None) -> torch.Tensor:
    """Decode attention: query [B, H, D], one token per request at position seq_lens[b] - 1.
    With num_splits > 1 the context is split (flash-decoding) and the last split of each
    (request, KV head) merges them (a second kernel past _MERGE_TICKETS of those, or where a
    KV head's query heads are wider than _MERGE_HEADS floats).
    An FP8 cache is read with its scales (reshape_and_cache). `pdl`: launch the kernels with
    programmatic dependent launch where the GPU has it. `logits_soft_cap`, `sinks` (float32
    [H]): as AttentionBackend.forward. `_config` (sweeps, tests) forces one tile config:
    BLOCK_N, num_warps, num_stages."""
    _require_triton()
    num_heads, kvh, d = _check_query(query, kv_cache)
    B = query.shape[0]
    assert seq_lens.shape[0] == B
    if out is None:
        out = torch.empty_like(query)
    if B == 0:
        return out
    assert out.stride(2) == 1 and block_tables.stride(1) == 1
    g = num_heads // kvh
    d_pad = max(16, _next_pow2(d))
    s0, sblk, soff, sh = _cache_strides(kv_cache)
    fp8, k_scale, v_scale = kv_scales(kv_cache, k_scale, v_scale)
    softcap, soft_cap, has_sinks, sinks = _soft_cap_and_sinks(query, logits_soft_cap, sinks)
    sliding = sliding_window is not None and sliding_window > 0
    num_splits = max(1, int(num_splits))
    use_splits = num_splits > 1
    if use_splits:
        m_part = torch.empty((B, num_heads, num_splits), device=query.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((B, num_heads, num_splits, d_pad), device=query.device,
                               dtype=torch.float32)
    else:  # unused by the kernel; any valid pointer will do
        m_part = l_part = acc_part = out
    g_p = _next_pow2(g)
    fused = use_splits and B * kvh <= _MERGE_TICKETS and g_p * d_pad <= _MERGE_HEADS
    tickets = _merge_tickets(query.device) if fused else out
    pdl = pdl_launch(query, pdl)
    kernel, forced = _decode_kernel, {}
    if _config is not None:
        forced = dict(_config)
        forced.setdefault("num_warps", 4)
        forced.setdefault("num_stages", 2)
        kernel = _decode_kernel.fn
    kernel[(B, kvh, num_splits)](
        query, kv_cache, out, m_part, l_part, acc_part, tickets, seq_lens, block_tables,
        k_scale, v_scale, sinks, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        s0, sblk, soff, sh, block_tables.stride(0),
        num_splits, sliding_window if sliding else 0, scale * _LOG2E, soft_cap,
        G=g, G_M=max(16, _next_pow2(g)), D=d, D_PAD=d_pad,
        BLOCK_SIZE=kv_cache.shape[2], SLIDING=sliding, DOT_PREC=_dot_precision(query.dtype),
        FP8=fp8, SOFTCAP=softcap, HAS_SINKS=has_sinks, USE_SPLITS=use_splits,
        FUSED_MERGE=fused, G_P=g_p, S_CHUNK=max(1, _MERGE_BLOCK // (g_p * d_pad)),
        USE_PDL=pdl, launch_pdl=pdl, **_read_mode(kv_cache, d_pad), **forced,
    )
    if use_splits and not fused:
        _decode_merge_kernel[(B, num_heads)](
            out, m_part, l_part, acc_part, out.stride(0), out.stride(1), num_heads, num_splits,
            D=d, D_PAD=d_pad, S_PAD=_next_pow2(num_splits), USE_PDL=pdl, launch_pdl=pdl,
        )
    return out
