"""One-row W4A16 product (batch-1 decode): y = x @ W^T (+ b) for one row x [1, K] and 4-bit
codes packed eight to an int32 along K (nibble i of word w is column 8w + i), with a scale and
(optionally) an integer zero point or a float minimum per group of G columns: the forms of
kernels/int4_matmul.py (ZERO_MODE 0: (q - 8) s, 1: (q - z) s, 2: q s + m).

At one row the product is a pass over the codes, and what bounds it is the work per code, not
the bytes: at the H200's 4.3 TB/s an SM must turn ~33 codes per clock into products, and a first
version spending ~9 instructions per code (shift, extract, OR, subtract, FMA, plus a gathered
and widened x element each) reached a quarter of the copy bandwidth. Here a code costs three:
- nibble j (0..3) of each 16-bit half of a word is masked in place and OR-ed into the mantissa
  of 2^23 by one LOP3 (inline PTX: the compiler otherwise emits an AND and an OR), which read
  as a float32 is exactly 2^23 + q 2^(4j); one FADD gives (q - 8) 2^(4j) (or q 2^(4j));
- one FFMA with x's element pre-scaled by 2^-4j (exact), into an fp32 partial per word.
x's elements are loaded, widened and scaled once per tile and shared by the two rows each
thread holds (the configs of 16-word tiles are laid out so). Scales and offsets are applied
once per word, not per code: a word's eight codes share a group, so its partial
sum_i q_i x_i is multiplied by the group's scale, and a zero point or minimum enters through
the word's sum of x (s (Σ q x - z Σ x), s Σ q x + m Σ x).

Tiles are [BLOCK_N rows, GROUPS, INNER words], INNER the words of one group (or of the tile,
if narrower): each [BLOCK_N, GROUPS] scale is one load per tile, and no reshape is needed.
Narrow outputs split K over SPLIT_K programs, reduced in split order through the skinny GEMV's
workspace (kernels/gemv.py).
"""
from __future__ import annotations

import torch

from folio.model.kernels import gemv
from folio.model.kernels._common import HAS_TRITON, INTERPRET, pdl_launch, tl, triton

# (BLOCK_N, BLOCK_W words, SPLIT_K, num_warps, num_stages); N and K are runtime arguments, so
# each config compiles once per (G, ZERO_MODE, bias) for all of a model's shapes.
_CONFIGS = [
    # 16-word (one group of 128) tiles laid out two rows of four words per thread, so each
    # element of x is loaded, widened and rescaled once for two rows; warps from 1 to 8 keep
    # the programs many at every N, and narrow outputs split K
    (64, 16, 1, 4, 2), (32, 16, 1, 2, 2), (16, 16, 1, 1, 2), (128, 16, 1, 8, 2),
    (32, 16, 2, 2, 2), (16, 16, 2, 1, 2), (16, 16, 4, 1, 2), (32, 16, 4, 2, 2),
    (64, 16, 4, 4, 2),
    # wider tiles (and groups narrower than 16 words)
    (8, 64, 1, 4, 2), (16, 32, 1, 2, 2), (32, 32, 1, 4, 2),
]
_INTERPRET_CONFIGS = [(4, 8, 1, 4, 1)]



def _configs() -> list:
    chosen = _INTERPRET_CONFIGS if INTERPRET else _CONFIGS
    return [triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk},
                          num_warps=w, num_stages=st) for bn, bw, sk, w, st in chosen]


def fits(n: int, k: int, g: int, block_n: int, block_w: int, split_k: int) -> bool:
    """Whether a tile of `block_w` words (and a K split in `split_k`) fits the shape: whole
    tiles per split, groups that tile the tile or a tile inside one group, split-K only where
    the GEMV workspace holds the partials (one row: split_k * N floats) and the tickets."""
    kw, wpg = k // 8, g // 8
    if k % 8 or g % 8 or kw % (block_w * split_k):
        return False
    if (block_w > wpg and block_w % wpg) or (block_w < wpg and wpg % block_w):
        return False
    partials, counters = gemv.workspace_capacity()
    return split_k == 1 or (split_k * n <= partials and triton.cdiv(n, block_n) <= counters)


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    args = {**named_args, **kwargs}
    n, k, g = args["N"], args["K"], args["G"]
    kept = [c for c in configs
            if fits(n, k, g, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_W"], c.kwargs["SPLIT_K"])]
    if kept:
        return kept
    # A K that no listed tile divides (e.g. SmolLM2's 576 with GGUF groups of 32): the widest
    # power-of-two tile that does, from the first config's shape.
    base = configs[0]
    bn, bw = base.kwargs["BLOCK_N"], base.kwargs["BLOCK_W"]
    while bw > 1 and not fits(n, k, g, bn, bw, 1):
        bw //= 2
    if not fits(n, k, g, bn, bw, 1):
        raise ValueError(f"no 4-bit GEMV tile fits K={k} with groups of {g}")
    return [triton.Config({**base.kwargs, "BLOCK_W": bw, "SPLIT_K": 1},
                          num_warps=base.num_warps, num_stages=base.num_stages)]


if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import pdl_entry

    # float32 2^23: a nibble OR-ed into its mantissa reads as exactly 2^23 + q
    _MAGIC = tl.constexpr(0x4B000000)
    _MAGIC_F = tl.constexpr(8388608.0)
    # The interpreter runs no PTX: it takes the two-operation form of the same bits.
    _ASM = tl.constexpr(not INTERPRET)

    @triton.jit
    def _nibble_bits(v, J: tl.constexpr):
        """(v & (0xF << 4J)) | 2^23's bits, as one LOP3 (the compiler otherwise emits an AND
        and an OR)."""
        if not _ASM:
            out = (v & (0xF << (4 * J))) | _MAGIC
        elif J == 0:
            out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 15, 1258291200, 0xEA;", "=r,r",
                                            [v], dtype=tl.uint32, is_pure=True, pack=1)
        elif J == 1:
            out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 240, 1258291200, 0xEA;", "=r,r",
                                            [v], dtype=tl.uint32, is_pure=True, pack=1)
        elif J == 2:
            out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 3840, 1258291200, 0xEA;",
                                            "=r,r", [v], dtype=tl.uint32, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 61440, 1258291200, 0xEA;",
                                            "=r,r", [v], dtype=tl.uint32, is_pure=True, pack=1)
        return out

    @triton.jit
    def _apply_group(part, xsum, s_ptrs, z_ptrs, ZERO_MODE: tl.constexpr):
        """A word's partial sum_i q_i x_i (q - 8 in form 0) with its group's scale, zero point
        or minimum (pointers shaped [BLOCK_N, GROUPS], broadcast over the words)."""
        s = tl.load(s_ptrs).to(tl.float32)[:, :, None]
        if ZERO_MODE == 1:
            z = tl.load(z_ptrs).to(tl.float32)[:, :, None]
            out = s * (part - z * xsum[None, :, :])
        elif ZERO_MODE == 2:
            mn = tl.load(z_ptrs).to(tl.float32)[:, :, None]
            out = s * part + mn * xsum[None, :, :]
        else:
            out = s * part
        return out

    @autotune(configs=_configs(), key=["N", "K", "G", "ZERO_MODE"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _gemv4_kernel(X, QW, SC, ZP, B, OUT, P, C, N, K, KW, G: tl.constexpr,
                      ZERO_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        WPG: tl.constexpr = G // 8
        INNER: tl.constexpr = WPG if WPG < BLOCK_W else BLOCK_W
        GROUPS: tl.constexpr = BLOCK_W // INNER
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past N read row N - 1 (valid memory) and are never stored.
        cols_c = tl.minimum(cols, N - 1).to(tl.int64)
        # KW = K / 8 is an argument (not computed here) so that its divisibility by 16 is
        # known and rows of words load as 16-byte vectors.
        n_groups = K // G
        w_rows = QW + cols_c[:, None, None] * KW
        s_rows = SC + cols_c[:, None] * n_groups
        z_rows = ZP + cols_c[:, None] * n_groups
        # word offsets within a tile [GROUPS, INNER], and their first columns of x
        w_in = (tl.arange(0, GROUPS) * INNER)[:, None] + tl.arange(0, INNER)[None, :]
        g_in = tl.arange(0, GROUPS) * INNER
        x_in = w_in * 8     # word w, nibble i: column 8 w + i
        if ZERO_MODE == 0:
            bias_f = _MAGIC_F + 8.0     # (2^23 + q) - (2^23 + 8) = q - 8, exactly
        else:
            bias_f = _MAGIC_F
        tiles = KW // (BLOCK_W * SPLIT_K)
        t_lo = pid_k * tiles
        t_hi = t_lo + tiles
        # The first tiles are no kernel's output: under PDL they stream in while the kernel
        # before this one finishes. Each iteration then loads the tile two ahead before
        # working on its own (the loop is not software-pipelined for loads that feed no
        # tl.dot, and one program's two tiles in flight are what hides the memory latency).
        ahead1 = tl.load(w_rows + (t_lo * BLOCK_W + w_in)[None, :, :])
        ahead2 = tl.load(w_rows + ((t_lo + 1) * BLOCK_W + w_in)[None, :, :],
                         mask=t_lo + 1 < t_hi, other=0)
        pdl_entry(USE_PDL)
        acc = tl.zeros((BLOCK_N, GROUPS, INNER), dtype=tl.float32)
        for t in range(t_lo, t_hi):
            w0 = t * BLOCK_W
            cur = ahead1.to(tl.uint32, bitcast=True)   # logical shifts
            ahead1 = ahead2
            ahead2 = tl.load(w_rows + (w0 + 2 * BLOCK_W + w_in)[None, :, :],
                             mask=t + 2 < t_hi, other=0)
            x_base = X + t * (BLOCK_W * 8) + x_in
            # Nibble j (0..3) of each 16-bit half, masked in place and OR-ed into the
            # mantissa of 2^23, reads as 2^23 + q 2^(4j), exactly, with no shift (one LOP3);
            # minus 2^23 (+ 8 2^(4j)) that is (q - 8) 2^(4j), and x's element is scaled by
            # 2^-4j instead (once per element, shared by the two rows a thread holds), so a
            # code costs a LOP3, an FADD and an FFMA.
            hi = cur >> 16
            part = tl.zeros((BLOCK_N, GROUPS, INNER), dtype=tl.float32)
            xsum = tl.zeros((GROUPS, INNER), dtype=tl.float32)
            for j in tl.static_range(4):
                x_lo = tl.load(x_base + j).to(tl.float32)
                x_hi = tl.load(x_base + (j + 4)).to(tl.float32)
                if ZERO_MODE != 0:
                    xsum += x_lo + x_hi
                unit = 1 << (4 * j)
                off = _MAGIC_F + (8.0 * unit if ZERO_MODE == 0 else 0.0)
                q_lo = _nibble_bits(cur, j).to(tl.float32, bitcast=True) - off
                q_hi = _nibble_bits(hi, j).to(tl.float32, bitcast=True) - off
                part += q_lo * (x_lo * (1.0 / unit))[None, :, :]
                part += q_hi * (x_hi * (1.0 / unit))[None, :, :]
            g_off = ((w0 + g_in) // WPG)[None, :]
            acc += _apply_group(part, xsum, s_rows + g_off, z_rows + g_off, ZERO_MODE)
        total = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]     # [1, BLOCK_N]
        offs_m = tl.arange(0, 1)
        is_last = True
        if SPLIT_K > 1:
            is_last, total = gemv._split_reduce(total, P, C, pid_n, pid_k, offs_m, cols, 1, N,
                                                SPLIT_K)
        if is_last:
            if HAS_BIAS:
                total += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + cols[None, :], total.to(OUT.dtype.element_ty),
                     mask=cols[None, :] < N)


def supported(k: int, group_size: int) -> bool:
    """Whether some tile of this kernel fits K and G (the packed words and whole groups)."""
    return k % 8 == 0 and group_size % 8 == 0 and k % group_size == 0


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              offsets: torch.Tensor | None, zero_mode: int, group_size: int,
              bias: torch.Tensor | None, out: torch.Tensor, *, pdl: bool = False, _config: dict | None = None) -> torch.Tensor:
    """x [1, K] (contiguous) @ W^T (+ bias) into out [1, N]; the arguments as
    int4_matmul.int4_matmul has checked them. `pdl`: launch with programmatic dependent
    launch where the GPU has it (kernels/_common.pdl_launch). `_config` (tests) forces one
    tile config."""
    n, k = packed.shape[0], packed.shape[1] * 8
    partials, counters = gemv._workspace(x.device)
    args = (x, packed, scales, offsets if offsets is not None else scales,
            bias if bias is not None else scales, out, partials, counters, n, k, k // 8)
    pdl = pdl_launch(x, pdl)
    meta = dict(G=group_size, ZERO_MODE=zero_mode, HAS_BIAS=bias is not None, USE_PDL=pdl, launch_pdl=pdl)
    if _config is None:
        _gemv4_kernel[lambda c: (triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])](*args, **meta)
        return out
    config = dict(_config)
    warps, stages = config.pop("num_warps", 4), config.pop("num_stages", 1)
    if not fits(n, k, group_size, config["BLOCK_N"], config["BLOCK_W"], config["SPLIT_K"]):
        raise ValueError(f"config {_config} does not fit N={n}, K={k}, G={group_size}")
    _gemv4_kernel.fn[(triton.cdiv(n, config["BLOCK_N"]), config["SPLIT_K"])](
        *args, **meta, **config, num_warps=warps, num_stages=stages)
    return out
