"""Session 30's experiment: ways for the decode kernel to read an FP8 cache, each a small
stand-alone kernel (one split, no window, scales 1), timed as the engine runs decode (a CUDA
graph of calls over enough layers' caches that K/V come from memory), best of a few tile
configs, at batches 64 and 256, with folio's own kernel over both caches in the same run.

    python tools/gpu_fp8_decode_variants.py [MODES, default 4,0,1,2,3]
    python tools/gpu_fp8_decode_variants.py --dump DIR   # TTGIR / PTX of some modes

MODE 0: K/V tiles widened to fp16 (folio's kernel before session 30), q fp16
MODE 1: q quantized to e4m3 per row, q.K^T on float8 operands; V widened
MODE 2: MODE 1 and P.V on float8 operands (p x 256 in e4m3). On sm_90 with 16-row tiles
        (mma.sync) Triton widens float8 operands to fp16 itself: 1 and 2 time as 0.
MODE 3: K/V widened by integer ops (bits shifted into fp16, x 2^8 folded into the scales)
MODE 4: bf16 cache (the rate to reach)
MODE 5: fp8, the scores as K.q^T (keys as the product's rows); MODE 6: the same over bf16
MODE 7: fp8 read as int16 pairs, each widened by one cvt (what folio's decode kernel now does);
MODE 8: pairs widened by bit shifts; MODE 9: pairs split into bytes, each converted
MODE 20/40/80 (+4 for bf16): 2/4/8 KV heads a program, the query block-diagonal
MODE + 10 (0-9): the grid (KV head, request), a request's KV heads in adjacent programs
Findings (H100): only the pairs (7) moved the FP8 rate, 2,194 -> 2,793 GB/s of K/V at batch
256 x 1,024 (bf16: 3,050); tools/sass_counts.py shows why (byte-wide shared loads).
"""
import math
import os
import sys

import torch
import triton
import triton.language as tl

from folio.model.attention import triton_kernels as tk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_sweep_decode_splits import graph_us  # noqa: E402


@triton.jit
def _rows(BT_row, k_pos, seq_len, head, stride_cblk, stride_coff, stride_ch,
          BLOCK_SIZE: tl.constexpr):
    """Cache offsets of keys k_pos of KV head `head`, and which are in the context."""
    in_ctx = k_pos < seq_len
    page = tl.load(BT_row + k_pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    return page * stride_cblk + (k_pos % BLOCK_SIZE) * stride_coff + head * stride_ch, in_ctx


@triton.jit
def _softmax(s, m_i, l_i, in_ctx):
    """Online softmax over scores s [M, N]: (p, alpha, m_new, l_new)."""
    s = tl.where(in_ctx[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _widen(x, MODE: tl.constexpr):
    if MODE == 3:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True)
    return x.to(tl.float16)


@triton.jit
def _kern(Q, KV, O, SEQ, BT, stride_qt, stride_qh, stride_c0, stride_cblk, stride_coff,
          stride_ch, stride_bt, qk_scale, k_scale, v_scale,
          G: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          MODE: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        b = tl.program_id(1)
        kvh = tl.program_id(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    seq_len = tl.load(SEQ + b)
    hd = tl.arange(0, G_M)
    d = tl.arange(0, D)
    heads = kvh * G + hd
    q_mask = (hd < G)[:, None]
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0).to(tl.float32)
    qs = qk_scale * k_scale
    vs = v_scale
    if MODE == 3:
        qs = qs * 256.0
        vs = vs * 256.0
    if MODE == 1 or MODE == 2:
        amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-6)
        q_sc = amax / 448.0
        q = (q / q_sc[:, None]).to(tl.float8e4nv)
        qrow = qs * q_sc
    else:
        if MODE == 4 or MODE == 6:
            q = q.to(tl.bfloat16)
        else:
            q = q.to(tl.float16)
        qrow = tl.zeros([G_M], tl.float32) + qs
    m_i = tl.full([G_M], float("-inf"), tl.float32)
    l_i = tl.zeros([G_M], tl.float32)
    acc = tl.zeros([G_M, D], tl.float32)
    BT_row = BT + b64 * stride_bt
    for s0 in range(0, seq_len, BLOCK_N):
        k_pos = s0 + tl.arange(0, BLOCK_N)
        row, in_ctx = _rows(BT_row, k_pos, seq_len, kvh, stride_cblk, stride_coff, stride_ch,
                            BLOCK_SIZE)
        k = tl.load(KV + row[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
        if MODE == 5 or MODE == 6:
            # keys as the product's rows: the FP8 tile is read in its own layout (no transpose)
            sT = tl.dot(k.to(q.dtype), tl.trans(q)) * qrow[None, :]        # [N, G_M]
            sT = tl.where(in_ctx[:, None], sT, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sT, 0))
            pT = tl.math.exp2(sT - m_new[None, :])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(pT, 0)
            v = tl.load(KV + stride_c0 + row[:, None] + d[None, :], mask=in_ctx[:, None],
                        other=0.0)
            pv = tl.dot(tl.trans(pT).to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv
        else:
            if MODE == 1 or MODE == 2:
                s = tl.dot(q, tl.trans(k))
            elif MODE == 4:
                s = tl.dot(q, tl.trans(k))
            else:
                s = tl.dot(q, tl.trans(_widen(k, MODE)))
            p, alpha, m_new, l_i = _softmax(s * qrow[:, None], m_i, l_i, in_ctx)
            v = tl.load(KV + stride_c0 + row[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
            if MODE == 2:
                pv = tl.dot((p * 256.0).to(tl.float8e4nv), v) * (1.0 / 256.0)
            elif MODE == 4:
                pv = tl.dot(p.to(tl.bfloat16), v)
            else:
                pv = tl.dot(p.to(tl.float16), _widen(v, MODE))
            acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * vs / l_i[:, None]
    tl.store(O + b64 * stride_qt + heads[:, None] * stride_qh + d[None, :],
             out.to(O.dtype.element_ty), mask=q_mask)


@triton.jit
def _kern_multi(Q, KV, O, SEQ, BT, stride_qt, stride_qh, stride_c0, stride_cblk, stride_coff,
                stride_ch, stride_bt, qk_scale,
                G: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, KV_PER: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV_PER KV heads a program: the query block-diagonal over [KV_PER * D] columns, so one
    key's KV_PER heads are one contiguous read."""
    kv0 = tl.program_id(0) * KV_PER
    b = tl.program_id(1)
    seq_len = tl.load(SEQ + b)
    DD: tl.constexpr = KV_PER * D
    r = tl.arange(0, G_M)
    c = tl.arange(0, DD)
    row_ok = r < KV_PER * G
    same = (r // G)[:, None] == (c // D)[None, :]
    heads = kv0 * G + r
    b64 = b.to(tl.int64)
    qmask = row_ok[:, None] & same
    q = tl.load(Q + b64 * stride_qt + heads[:, None] * stride_qh + (c % D)[None, :],
                mask=qmask, other=0.0)
    if BF16:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float16)
    m_i = tl.full([G_M], float("-inf"), tl.float32)
    l_i = tl.zeros([G_M], tl.float32)
    acc = tl.zeros([G_M, DD], tl.float32)
    BT_row = BT + b64 * stride_bt
    for s0 in range(0, seq_len, BLOCK_N):
        k_pos = s0 + tl.arange(0, BLOCK_N)
        row, in_ctx = _rows(BT_row, k_pos, seq_len, kv0, stride_cblk, stride_coff, stride_ch,
                            BLOCK_SIZE)
        k = tl.load(KV + row[:, None] + c[None, :], mask=in_ctx[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        p, alpha, m_new, l_i = _softmax(s, m_i, l_i, in_ctx)
        v = tl.load(KV + stride_c0 + row[:, None] + c[None, :], mask=in_ctx[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b64 * stride_qt + heads[:, None] * stride_qh + (c % D)[None, :],
             out.to(O.dtype.element_ty), mask=qmask)


@triton.jit
def _pair_to_f16(x, BITS: tl.constexpr):
    """uint16 holding two e4m3 (element 2i low byte, 2i+1 high) -> (fp16 of the low, of the
    high). BITS: shifted bits (x 2^-8, the caller folds 2^8 into its scales); else cvt."""
    if BITS == 2:
        x = x.to(tl.uint16, bitcast=True)
        lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi
    if BITS:
        x = x.to(tl.uint16, bitcast=True)
        lo = ((x << 7) & 0x3F80) | ((x << 8) & 0x8000)
        hi = ((x >> 1) & 0x3F80) | (x & 0x8000)
        return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
        "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _kern_pairs(Q, KV, O, SEQ, BT, stride_qt, stride_qh, stride_c0, stride_cblk, stride_coff,
                stride_ch, stride_bt, qk_scale,
                G: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The FP8 cache read as uint16 pairs: even and odd head-dim elements are two tiles, so
    every shared-memory read is 16-bit (ldmatrix), and q.k = q_even.k_even + q_odd.k_odd."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SEQ + b)
    hd = tl.arange(0, G_M)
    D2: tl.constexpr = D // 2
    e = tl.arange(0, D2)
    heads = kvh * G + hd
    q_mask = (hd < G)[:, None]
    b64 = b.to(tl.int64)
    qp = Q + b64 * stride_qt + heads[:, None] * stride_qh + 2 * e[None, :]
    q_e = tl.load(qp, mask=q_mask, other=0.0).to(tl.float16)
    q_o = tl.load(qp + 1, mask=q_mask, other=0.0).to(tl.float16)
    if BITS == 1:
        qk_scale = qk_scale * 256.0
    m_i = tl.full([G_M], float("-inf"), tl.float32)
    l_i = tl.zeros([G_M], tl.float32)
    acc_e = tl.zeros([G_M, D2], tl.float32)
    acc_o = tl.zeros([G_M, D2], tl.float32)
    BT_row = BT + b64 * stride_bt
    for s0 in range(0, seq_len, BLOCK_N):
        k_pos = s0 + tl.arange(0, BLOCK_N)
        row, in_ctx = _rows(BT_row, k_pos, seq_len, kvh, stride_cblk, stride_coff, stride_ch,
                            BLOCK_SIZE)
        kw = tl.load(KV + row[:, None] + e[None, :], mask=in_ctx[:, None], other=0)
        k_e, k_o = _pair_to_f16(kw, BITS)
        s = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))
        p, alpha, m_new, l_i = _softmax(s * qk_scale, m_i, l_i, in_ctx)
        vw = tl.load(KV + stride_c0 + row[:, None] + e[None, :], mask=in_ctx[:, None], other=0)
        v_e, v_o = _pair_to_f16(vw, BITS)
        p16 = p.to(tl.float16)
        acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
        acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
        m_i = m_new
    vs = 1.0
    if BITS == 1:
        vs = 256.0
    inv = vs / l_i
    op = O + b64 * stride_qt + heads[:, None] * stride_qh + 2 * e[None, :]
    tl.store(op, (acc_e * inv[:, None]).to(O.dtype.element_ty), mask=q_mask)
    tl.store(op + 1, (acc_o * inv[:, None]).to(O.dtype.element_ty), mask=q_mask)


def run(mode, q, cache, seq_lens, bt, out, scale, cfg):
    B, H, D = q.shape
    kvh = cache.shape[3]
    g = H // kvh
    if mode in (7, 8, 9):
        c16 = cache.view(torch.int16)
        return _kern_pairs[(B, kvh)](q, c16, out, seq_lens, bt, q.stride(0), q.stride(1),
                                     *c16.stride()[:4], bt.stride(0),
                                     scale * 1.4426950408889634, G=g, G_M=max(16, g), D=D,
                                     BLOCK_SIZE=cache.shape[2], BITS={7: 0, 8: 1, 9: 2}[mode],
                                     BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    if mode >= 20:
        per = mode // 10
        _kern_multi[(kvh // per, B)](q, cache, out, seq_lens, bt, q.stride(0), q.stride(1),
                                     *cache.stride()[:4], bt.stride(0),
                                     scale * 1.4426950408889634, G=g,
                                     G_M=max(16, triton.next_power_of_2(per * g)), D=D,
                                     KV_PER=per, BLOCK_SIZE=cache.shape[2], BF16=mode % 10 == 4,
                                     BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
        return
    swap = mode >= 10
    mode = mode % 10
    return _kern[(kvh, B) if swap else (B, kvh)](
                    q, cache, out, seq_lens, bt, q.stride(0), q.stride(1), *cache.stride()[:4],
                    bt.stride(0), scale * 1.4426950408889634, 1.0, 1.0,
                    G=g, G_M=max(16, g), D=D, BLOCK_SIZE=cache.shape[2], MODE=mode,
                    BLOCK_N=cfg[0], SWAP=swap, num_warps=cfg[1], num_stages=cfg[2])


CFGS = [(32, 2, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (64, 8, 3)]


def dump(out_dir):
    """Each mode's compiled kernel (TTGIR, PTX, SASS-level counts) for reading off the GPU."""
    dev, dt = "cuda", torch.bfloat16
    h, kvh, d, blk, batch, ctx = 32, 8, 128, 16, 4, 256
    pages = ctx // blk
    src = torch.randn(2, batch * pages, blk, kvh, d, device=dev, dtype=dt)
    c8 = src.to(torch.float8_e4m3fn)
    bt = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, h, d, device=dev, dtype=dt)
    out = torch.empty_like(q)
    for mode in (4, 0, 5, 6):
        for cfg in [(32, 2, 2), (128, 4, 2)]:
            k = run(mode, q, src if mode in (4, 6) else c8, seq_lens, bt, out, 0.1, cfg)
            name = f"M{mode}_{cfg[0]}_{cfg[1]}_{cfg[2]}"
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
                    f.write(k.asm[ext])
            ptx = k.asm["ptx"]
            print(name, "regs", k.n_regs, "spills", k.n_spills,
                  {w: ptx.count(w) for w in ("cp.async", "cvt.rn.f16x2.e4m3x2", "ld.global",
                                               "mma.sync", "wgmma", "ldmatrix", "st.shared",
                                               "ld.shared", "bar.sync")}, flush=True)


def main():
    if sys.argv[1:2] == ["--dump"]:
        return dump(sys.argv[2])
    dev, dt = "cuda", torch.bfloat16
    h, kvh, d, blk = 32, 8, 128, 16
    modes = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "4,0,1,2,3").split(",")]
    for batch, ctx in [(64, 1024), (256, 512), (256, 1024)]:
        pages = math.ceil(ctx / blk)
        per = 2 * batch * pages * blk * kvh * d
        layers = max(2, min(32, math.ceil((256 << 20) / per)))
        src = [torch.randn(2, batch * pages, blk, kvh, d, device=dev, dtype=dt)
               for _ in range(layers)]
        c8 = [x.to(torch.float8_e4m3fn) for x in src]
        bt = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
        seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, h, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        scale = d ** -0.5
        ref8 = tk.paged_attention_decode(q.float(), c8[0].float(), seq_lens, bt, scale,
                                         _config={"BLOCK_N": 32}).float()
        ref16 = tk.paged_attention_decode(q.float(), src[0].float(), seq_lens, bt, scale,
                                          _config={"BLOCK_N": 32}).float()
        line = [f"b={batch} ctx={ctx}:"]
        for mode in modes:
            caches = src if mode % 10 in (4, 6) else c8
            ref = ref16 if mode % 10 in (4, 6) else ref8
            best = None
            for cfg in CFGS:
                try:
                    run(mode, q, caches[0], seq_lens, bt, out, scale, cfg)
                    torch.cuda.synchronize()
                    err = (out.float() - ref).abs().max().item()
                    t = graph_us(lambda i: run(mode, q, caches[i % layers], seq_lens, bt, out,
                                               scale, cfg), 2 * layers)
                except Exception as e:  # noqa: BLE001
                    print(f"mode {mode} {cfg}: {type(e).__name__} {str(e)[:200]}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            if best:
                eb = caches[0].element_size()
                gbs = 2 * batch * ctx * kvh * d * eb / (best[0] * 1e3)
                line.append(f"M{mode} {best[0]:.1f}us {gbs:.0f}GB/s {best[1]} err {best[2]:.2e}")
        # the real kernel, both caches, its best config from the same list
        for name, caches in (("folio-bf16", src), ("folio-fp8", c8)):
            best = None
            for cfg in CFGS:
                c = {"BLOCK_N": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}
                t = graph_us(lambda i: tk.paged_attention_decode(
                    q, caches[i % layers], seq_lens, bt, scale, out=out, pdl=True,
                    _config=c), 2 * layers)
                best = min(best or (t, cfg), (t, cfg))
            line.append(f"{name} {best[0]:.1f}us {best[1]}")
        print(" | ".join(line), flush=True)
        del src, c8


if __name__ == "__main__":
    main()
