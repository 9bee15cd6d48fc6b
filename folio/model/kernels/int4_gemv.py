"""One-row W4A16 product (batch-1 decode): y = x @ W^T (+ b) for one row x [1, K] and 4-bit
codes packed eight to an int32 along K (nibble i of word w is column 8w + i), with a scale and
(optionally) an integer zero point or a float minimum per group of G columns: the forms of
kernels/int4_matmul.py (ZERO_MODE 0: (q - 8) s, 1: (q - z) s, 2: q s + m).

At one row the product is a pass over the codes, and what bounds it is the work per code, not
the bytes: at the H200's 4.3 TB/s the GPU must turn ~8.6e12 codes a second into products, ~33
per SM per clock, against four warp instructions an SM issues per clock. A float32 form (each
nibble OR-ed into the mantissa of 2^23, an FADD and an FFMA: ~5.9 instructions a code in its
loop as compiled) reached 25-45 % of the copy bandwidth. Here the arithmetic is in fp16 pairs:
- one LOP3 masks nibbles i and i + 4 of a word (the same place in its two 16-bit halves) and
  ORs them into the mantissa of fp16 1024: the pair (1024 + q_i, 1024 + q_{i+4}) exactly (or
  1024 + 16 q for the nibbles one place up, scaled back in the next step);
- one f16x2 SUB (or FMA) takes the pair to (q - z) exactly, z the zero point (8 for the
  symmetric form, 0 with minimums);
- one f16x2 FMA adds both lanes' products with x's pair to an fp16x2 partial over a
  thread's four consecutive words (its 16-byte load, _quad_dot); the lanes are added and
  widened to float32 once for those 32 codes. Thirteen instructions for a word's eight codes
  (dot_ptx builds the PTX; tests/model/test_int4_gemv_ptx.py emulates it). Where a group
  holds fewer than four words (groups of 16 columns), each word is widened (_word_dot).
fp16 holds x's elements exactly only within its range, so the 32 elements of four words are
scaled by the power of two that brings the largest into [1, 2) (exact), and 2^e is applied
with the scale: a lane's partial is at most 16 * 63 * 2 and cannot overflow, and elements far
below their block's largest lose only what cannot move the sum. (A block whose largest
element is subnormal, or 2^127 or more, contributes nothing; an infinite one gives NaN.)
Products and the partial are rounded to fp16's 11 bits: relative errors of 7-8e-4 against
float64 on Llama-sized rows (numpy emulation; 4.5e-4 when widened every word), up to 2.4e-3
for minimums with x of nonzero mean, where the m Σ x term cancels much of the sum, all well
inside the 4-bit codes' own error.
x's elements are loaded, scaled and packed once per word and shared by the rows a thread
holds (eight in the main configs). Scales and minimums are applied once per block of four
words (one word where groups are narrower): its codes share a group (s 2^e Σ (q - z) x',
+ m Σ x for minimums).

Tiles are loaded as [BLOCK_N rows, BLOCK_W words] (a warp's lanes on one row's contiguous
words) and viewed as [BLOCK_N, GROUPS, INNER], INNER the words of one group (or of the tile,
if narrower): each [BLOCK_N, GROUPS] scale is one load per tile.
Narrow outputs split K over SPLIT_K programs, reduced in split order through the skinny GEMV's
workspace (kernels/gemv.py).

The configs marked MMA run a tensor-core form instead (mma_ptx: the products on mma.sync, the
codes widened by a shift and one LOP3 a pair), behind a switch (MMA_AUTOTUNED). Session 31
ran FP8 e4m3 codes in the same form too; on an H100 it lost to the skinny GEMV by 18-24 % on
every Llama-3-8B projection and was removed (docs/benchmarks.md, sessions 31 and 32).
"""
from __future__ import annotations

import torch

from folio.model.kernels import gemv
from folio.model.kernels._common import (HAS_TRITON, INTERPRET, device_capability,
                                         pdl_launch, tl, triton)

# (BLOCK_N, BLOCK_W words, SPLIT_K, num_warps, num_stages, MMA); N and K are runtime
# arguments, so each config compiles once per (G, ZERO_MODE, bias, gate|up) for all of a
# model's shapes. MMA: the tensor-core form (mma_ptx), tiles of MMA_WORDS words.
_CONFIGS = [
    # 128-word tiles: a warp's 32 threads take four words (16 bytes) each of one row, so
    # each thread holds eight rows and its x elements are prepared once for the eight
    # (compiled for sm_90 here, groups of 128 columns: 2.3-2.6 instructions a code in the
    # loop, against ~5.9 for the float32 form's tiles and 3.0-3.3 widened every word and laid
    # out one row a thread; 2.9 for groups of 32); narrow outputs split K
    (32, 128, 1, 4, 1, False), (32, 128, 2, 4, 1, False), (32, 128, 4, 4, 1, False),
    (16, 128, 1, 2, 1, False), (16, 128, 2, 2, 1, False), (16, 128, 4, 2, 1, False),
    # four rows a thread: twice the programs for the narrow outputs (qkv, o); split in K
    # too, four to eight programs an SM there (not yet measured on a GPU)
    (16, 128, 1, 4, 1, False), (8, 128, 1, 2, 1, False),
    (16, 128, 2, 4, 1, False), (8, 128, 2, 2, 1, False), (8, 128, 4, 2, 1, False),
    # 64-word tiles, two rows a warp
    (32, 64, 1, 2, 1, False), (32, 64, 2, 2, 1, False), (32, 64, 4, 2, 1, False),
    (16, 64, 1, 2, 1, False),
    # 16-word tiles (one group of 128), for Ks the wider tiles do not divide
    (64, 16, 1, 4, 1, False),
    # The tensor-core form: 16 words (one group of 128 columns) a row a tile; a lane quad
    # holds them, eight rows a warp, BLOCK_N / (8 num_warps) rows a thread (an even number:
    # mma.sync takes two rows a lane). Timed on an H100 in session 32: latency-bound at
    # these sizes (a program's two tiles in flight, about one program an SM: time halved
    # with each doubling of the split).
    (64, 16, 1, 2, 1, True), (64, 16, 2, 2, 1, True), (64, 16, 4, 2, 1, True),
    (128, 16, 1, 4, 1, True), (128, 16, 2, 4, 1, True), (128, 16, 4, 4, 1, True),
    (128, 16, 1, 2, 1, True), (256, 16, 1, 4, 1, True),
    # more programs, so that more tiles are in flight an SM: one-warp programs and K split
    # 8 and 16 ways where the workspace holds the partials (fits)
    (32, 16, 4, 1, 1, True), (32, 16, 8, 1, 1, True), (32, 16, 16, 1, 1, True),
    (16, 16, 8, 1, 1, True), (64, 16, 8, 2, 1, True), (64, 16, 16, 2, 1, True),
    (128, 16, 8, 4, 1, True),
]
_INTERPRET_CONFIGS = [(4, 8, 1, 4, 1, False)]
# Whether the autotuner may pick the tensor-core form (_prune). Off: on an H100 W4A16 batch 1
# ran 1.4 % slower with it (session 32); kept for the H200, where the pair form is bound by its
# instructions. Read when a shape is tuned: a choice kept on disk from before a change stands.
MMA_AUTOTUNED = False
# The tensor-core form's tile: 16 words a row (128 columns), the k of two m16n8k16 products
# for each of a lane quad's four words.
MMA_WORDS = 16


def _configs() -> list:
    chosen = _INTERPRET_CONFIGS if INTERPRET else _CONFIGS
    return [triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk,
                           "MMA": mma_reps(bn, w) if mma else 0},
                          num_warps=w, num_stages=st) for bn, bw, sk, w, st, mma in chosen]


def mma_reps(block_n: int, num_warps: int) -> int:
    """The rows a lane holds in the tensor-core form (the kernel's MMA argument): eight rows
    a warp, the warps stacked."""
    return block_n // (8 * num_warps)


def fits(n: int, k: int, g: int, block_n: int, block_w: int, split_k: int,
         mma_warps: int = 0) -> bool:
    """Whether a tile of `block_w` words (and a K split in `split_k`) fits the shape: whole
    tiles per split, groups that tile the tile or a tile inside one group, split-K only where
    the GEMV workspace holds the partials (one row: split_k * N floats) and the tickets.
    `mma_warps`: the tensor-core form at that many warps (0: the fp16-pair form), which
    takes tiles of MMA_WORDS words inside one group and an even number of rows a thread."""
    kw, wpg = k // 8, g // 8
    if k <= 0 or k % 8 or g % 8 or kw % (block_w * split_k):
        return False
    if mma_warps and (block_w != MMA_WORDS or wpg % MMA_WORDS
                      or block_n % (16 * mma_warps)):
        return False
    if (block_w > wpg and block_w % wpg) or (block_w < wpg and wpg % block_w):
        return False
    partials, counters = gemv.workspace_capacity()
    return split_k == 1 or (split_k * n <= partials and triton.cdiv(n, block_n) <= counters)


def mma_operands_ok(x: torch.Tensor) -> bool:
    """Whether the tensor-core form can take x: 16-bit, its first element 16-byte aligned
    (the asm loads x 16 bytes at a time), and a GPU whose PTX has the form's instructions
    (mma.sync m16n8k16: sm_80). The interpreter runs the form's plain-Triton branch: any
    CPU tensor of 16 bits."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.data_ptr() % 16:
        return False
    if not x.is_cuda:
        return INTERPRET
    return device_capability(x.device.index or 0) >= (8, 0)


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    args = {**named_args, **kwargs}
    n, k, g = args["N"], args["K"], args["G"]
    if args.get("GATE_UP"):
        n *= 2      # both halves' rows are in the tiles and the split-K partials
    mma_ok = MMA_AUTOTUNED and mma_operands_ok(args["X"])
    kept = [c for c in configs
            if (mma_ok or not c.kwargs["MMA"])
            and fits(n, k, g, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_W"], c.kwargs["SPLIT_K"],
                     c.num_warps if c.kwargs["MMA"] else 0)]
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


# The largest zero point the fp16 subtrahends hold exactly (1024 + z and -(64 + z), the
# latter in steps of 1/16 below 128): the loader refuses others (GroupQuantLinear). Every
# format's zero points are 4-bit codes (0..15; GPTQ v1's stored zero - 1 read back as 1..16).
MAX_ZERO_POINT = 63


def dot_ptx(words: int) -> str:
    """The PTX of _word_dot (words=1) and _quad_dot (words=4): operand $0 the float32 sum,
    $1..$W the words, then four fp16x2 x pairs per word (columns 8w+0|8w+4, 1|5, 2|6, 3|7),
    then the subtrahends 1024 + z and -(64 + z). Per word: nibbles 0 and 4 (bits 0-3,
    16-19) masked and OR-ed into fp16 1024's mantissa by one LOP3 read as the pair 1024 + q
    exactly; nibbles 1 and 5 the same way read as 1024 + 16 q; a shift by 8 brings nibbles
    2, 3, 6, 7 into the same places. One f16x2 SUB (FMA by 1/16) gives q - z for both lanes,
    one f16x2 FMA adds their products with x to the fp16x2 partial; thirteen instructions
    for a word's eight codes. The partial's lanes are added and widened once at the end.
    Public for the CPU test that emulates it (the interpreter runs no PTX)."""
    x0 = words + 1                    # first x pair
    sub_lo, sub_hi = f"${x0 + 4 * words}", f"${x0 + 4 * words + 1}"
    lines = ["{", ".reg .b32 a, b, c, d, t, m, acc;", ".reg .f16 h0, h1;",
             "mov.b32 m, 0x2c002c00;"]
    for w in range(words):
        word, xs = f"${w + 1}", [f"${x0 + 4 * w + i}" for i in range(4)]
        lines += [f"lop3.b32 a, {word}, 0x000f000f, 0x64006400, 0xea;",
                  f"lop3.b32 b, {word}, 0x00f000f0, 0x64006400, 0xea;",
                  f"shr.u32 t, {word}, 8;",
                  "lop3.b32 c, t, 0x000f000f, 0x64006400, 0xea;",
                  "lop3.b32 d, t, 0x00f000f0, 0x64006400, 0xea;",
                  f"sub.f16x2 a, a, {sub_lo};", f"fma.rn.f16x2 b, b, m, {sub_hi};",
                  f"sub.f16x2 c, c, {sub_lo};", f"fma.rn.f16x2 d, d, m, {sub_hi};"]
        lines.append(f"mul.f16x2 acc, a, {xs[0]};" if w == 0
                     else f"fma.rn.f16x2 acc, a, {xs[0]}, acc;")
        lines += [f"fma.rn.f16x2 acc, {r}, {x}, acc;" for r, x in zip("bcd", xs[1:])]
    lines += ["mov.b32 {h0, h1}, acc;", "add.f16 h0, h0, h1;", "cvt.f32.f16 $0, h0;", "}"]
    return "\n".join(lines)


def dot_constraints(words: int) -> str:
    """The inline asm constraints of dot_ptx(words): one float32 out, 32-bit registers in."""
    return ",".join(["=f"] + ["r"] * (words + 4 * words + 2))


# The tensor-core form (configs with MMA). The fp16-pair form spends 13 instructions a word
# on its codes, four of them the products; here the products go to mma.sync m16n8k16, whose
# one instruction takes 64 codes of a lane pair of rows. What is left is widening: one LOP3 a
# pair of codes (each 16-bit half of a word gets nibble i of its half OR-ed into the mantissa
# of 128.0 in bf16, 1024.0 in fp16: the exact value BASE + q) after a shift that brings
# nibble i down (three shifts a word; bf16's 7-bit mantissa has no room for a nibble four
# places up, so the fp16 form's trick for them does not apply). No subtraction: with float32
# accumulators, sum (BASE + q) x - (BASE + z) sum x is sum (q - z) x to float32 rounding
# (relative 1e-5 of the sum of |x|, far below the codes' own error), and sum x, the same for
# every row, comes from the tensor cores too (a product with a matrix of ones).
#
# Lanes: the tile [BLOCK_N, 16 words] is loaded as Triton lays it out by itself for 16-byte
# loads of a 64-byte row (tests/model/test_int4_gemv_mma.py checks the layout the compiler
# chose): size per thread [1, 4], threads per warp [8, 4], order [1, 0]. Lane 4 g + c holds
# words 4c..4c+3 of rows g, g + 8 W, g + 16 W, ... (W warps), in registers word-fastest: the
# mma's group g and thread-in-group c. Every k of an m16n8k16 is a column somewhere in the
# tile, chosen alike for A and B: lane c's a0/b0 are columns (8w, 8w + 4), a2/b1 (8w + 1,
# 8w + 5), for its word w = 4c + j in the first product and (8w + 2, 8w + 6), (8w + 3, 8w + 7)
# in the second. A's rows g and g + 8 are the lane's two rows of a pair (a1, a3 the second
# row's codes). B's eight columns are all x (every lane loads its own x pairs), so every
# lane's d0 / d2 is its rows' whole dot over the tile, the same in the four lanes of a quad.
# The kernel's final sum over a row's lanes is then four times the result (scaled by 1/4).

# Compile-time helpers of the kernel (Triton calls them on constexpr arguments; callable from
# Python as they are).
_constexpr_function = triton.constexpr_function if HAS_TRITON else (lambda fn: fn)
# float32 PTX immediates of -BASE - z for z = 0 (form 1's subtrahend base, form 2) and 8
_NEG_BASE = {(128.0, 0): "0fC3000000", (128.0, 8): "0fC3080000",
             (1024.0, 0): "0fC4800000", (1024.0, 8): "0fC4810000"}


@_constexpr_function
def _mma_load_f32(dst: str, addr: str, kind: str) -> list:
    """PTX loading the float at `addr` (its dtype `kind`) into the 32-bit register `dst`."""
    if kind == "fp32":
        return [f"ld.global.b32 {dst}, [{addr}];"]
    if kind == "bf16":    # bf16 is float32's high half
        return [f"ld.global.b16 h, [{addr}];", f"mov.b32 {dst}, {{hz, h}};"]
    return [f"ld.global.b16 h, [{addr}];", f"cvt.f32.f16 {dst}, h;"]


@_constexpr_function
def mma_ptx(reps: int, zero_mode: int, x_f16: bool, s_kind: str, z_kind: str) -> str:
    """The PTX of one lane's tile step in the tensor-core form, `reps` rows a lane (even):
    operands (pack 4 reps, element e = 4 r + j: row rep r, word j of the lane's four) are the
    new accumulators ($0..), then the tile's words, the accumulators, the addresses of each
    row's scale, of its zero point (form 1) or minimum (form 2), and x's words as four int32
    operands (element j: word j's elements 2i, 2i + 1 in operand i). Only element 4 r of the
    accumulators carries row r (the others stay 0); address elements 4 r and x elements j
    (of row rep 0) are read. Per row: acc + s (D - (BASE + z) X) (form 2:
    acc + s (D - BASE X) + m X), D the mma sum of (BASE + q) x, X the tile's sum of x.
    Scales and offsets of `s_kind` / `z_kind` ("bf16", "fp16", "fp32"). Public for the CPU
    test that emulates it lane by lane."""
    if reps < 2 or reps % 2:
        raise ValueError(f"the tensor-core form takes an even number of rows a lane, not {reps}")
    p = 4 * reps
    ty = "f16" if x_f16 else "bf16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    base = 1024.0 if x_f16 else 128.0
    lop_base = "0x64006400" if x_f16 else "0x43004300"
    one = "0x3C003C00" if x_f16 else "0x3F803F80"
    n = iter(range(10 * p))
    out = [f"${next(n)}" for _ in range(p)]
    words = [f"${next(n)}" for _ in range(p)]
    acc = [f"${next(n)}" for _ in range(p)]
    s_addr = [f"${next(n)}" for _ in range(p)]
    z_addr = [f"${next(n)}" for _ in range(p)] if zero_mode else None
    # x's words: operand group i holds int32 i (elements 2i, 2i + 1) of each word's eight
    x_ops = [[f"${next(n)}" for _ in range(p)] for _ in range(4)]
    lines = ["{", ".reg .b32 xp<16>, one, t<3>, u<3>, a<4>, e<4>, s, z;",
             ".reg .b16 h, hz;", ".reg .f32 dx<4>, d<4>, v, zero, nz;",
             f"mov.b32 one, {one};", "mov.f32 zero, 0f00000000;", "mov.b16 hz, 0;"]
    # x: the lane's four words (32 elements, word j's in element j of the x operands), in
    # the pairs of the products' k order
    for j in range(4):
        r = [x_ops[i][j] for i in range(4)]
        lines += [f"prmt.b32 xp{4 * j}, {r[0]}, {r[2]}, 0x5410;",        # (x0, x4)
                  f"prmt.b32 xp{4 * j + 1}, {r[0]}, {r[2]}, 0x7632;",    # (x1, x5)
                  f"prmt.b32 xp{4 * j + 2}, {r[1]}, {r[3]}, 0x5410;",    # (x2, x6)
                  f"prmt.b32 xp{4 * j + 3}, {r[1]}, {r[3]}, 0x7632;"]    # (x3, x7)
    # X = the tile's sum of x, in every lane: ones against the same pairs
    for i in range(0, 16, 2):
        c = "zero, zero, zero, zero" if i == 0 else "dx0, dx1, dx2, dx3"
        lines.append(f"{mma} {{dx0, dx1, dx2, dx3}}, {{one, one, one, one}}, "
                     f"{{xp{i}, xp{i + 1}}}, {{{c}}};")
    for pair in range(reps // 2):
        top, bottom = 8 * pair, 8 * pair + 4          # elements of rows 2 pair, 2 pair + 1
        for j in range(4):
            wt, wb = words[top + j], words[bottom + j]
            lines += [f"shr.u32 t{i}, {wt}, {4 * (i + 1)};" for i in range(3)]
            lines += [f"shr.u32 u{i}, {wb}, {4 * (i + 1)};" for i in range(3)]
            srcs = [(wt, wb), ("t0", "u0"), ("t1", "u1"), ("t2", "u2")]
            for i in range(4):
                lines += [f"lop3.b32 a{i}, {srcs[i][0]}, 0x000f000f, {lop_base}, 0xea;",
                          f"lop3.b32 e{i}, {srcs[i][1]}, 0x000f000f, {lop_base}, 0xea;"]
            for h in range(2):
                c = "zero, zero, zero, zero" if j == 0 and h == 0 else "d0, d1, d2, d3"
                lines.append(f"{mma} {{d0, d1, d2, d3}}, {{a{2 * h}, e{2 * h}, a{2 * h + 1}, "
                             f"e{2 * h + 1}}}, {{xp{4 * j + 2 * h}, xp{4 * j + 2 * h + 1}}}, "
                             f"{{{c}}};")
        for half in range(2):
            el, dreg = (top, "d0") if half == 0 else (bottom, "d2")
            lines += _mma_load_f32("s", s_addr[el], s_kind)
            if zero_mode == 1:
                lines += _mma_load_f32("z", z_addr[el], z_kind)
                lines.append(f"sub.f32 nz, {_NEG_BASE[base, 0]}, z;")
            else:
                lines.append(f"mov.f32 nz, {_NEG_BASE[base, 8 if zero_mode == 0 else 0]};")
            lines += [f"fma.rn.f32 v, nz, dx0, {dreg};",
                      f"fma.rn.f32 {out[el]}, s, v, {acc[el]};"]
            if zero_mode == 2:
                lines += _mma_load_f32("z", z_addr[el], z_kind)
                lines.append(f"fma.rn.f32 {out[el]}, z, dx0, {out[el]};")
            lines += [f"mov.f32 {out[el + j]}, zero;" for j in range(1, 4)]
    lines.append("}")
    return "\n".join(lines)


@_constexpr_function
def mma_constraints(reps: int, zero_mode: int) -> str:
    """The inline asm constraints of mma_ptx: float32 outs; words, accumulators, addresses,
    x's words."""
    p = 4 * reps
    addresses = (2 if zero_mode else 1) * p
    return ",".join(["=f"] * p + ["r"] * p + ["f"] * p + ["l"] * addresses + ["r"] * 4 * p)


if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import pdl_entry

    # The interpreter runs no PTX: it takes the plain-Triton form of the same arithmetic.
    _ASM = tl.constexpr(not INTERPRET)
    _WORD_PTX = tl.constexpr(dot_ptx(1))
    _WORD_CONSTRAINTS = tl.constexpr(dot_constraints(1))
    _QUAD_PTX = tl.constexpr(dot_ptx(4))
    _QUAD_CONSTRAINTS = tl.constexpr(dot_constraints(4))
    # fp16 bits of 1024 and of -64. The dequant subtrahends of a zero point z, 1024 + z and
    # -(64 + z), are these bits plus z and plus 16 z (fp16's step is 1 at 1024 and 1/16 at
    # 64), put in both halves of a word (_subtrahends).
    _LO_BASE = tl.constexpr(0x6400)
    _HI_BASE = tl.constexpr(0xD400)

    @triton.jit
    def _half2(lo, hi):
        """Two float32 tensors -> their fp16 values packed in a uint32 (lo in bits 0-15), one
        cvt.rn.f16x2.f32 (which takes the high half first)."""
        if _ASM:
            out = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo],
                                            dtype=tl.uint32, is_pure=True, pack=1)
        else:
            out = (lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
                   | (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
        return out

    @triton.jit
    def _half_lane(v, SHIFT: tl.constexpr):
        """The fp16 in bits SHIFT..SHIFT+15 of a uint32, as float32 (the interpreter form)."""
        return ((v >> SHIFT) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _pair_ref(word, xp, c_lo, SHIFT: tl.constexpr):
        """Interpreter form of one f16x2 lane pair: nibbles SHIFT/4 and SHIFT/4 + 4 of the word
        against x's pair, in float32."""
        z = ((c_lo & 0xFFFF) - _LO_BASE).to(tl.float32)
        q_lo = ((word >> SHIFT) & 0xF).to(tl.float32) - z
        q_hi = ((word >> (SHIFT + 16)) & 0xF).to(tl.float32) - z
        return q_lo * _half_lane(xp, 0) + q_hi * _half_lane(xp, 16)

    @triton.jit
    def _word_dot(word, x04, x15, x26, x37, c_lo, c_hi):
        """sum_i (q_i - z) x'_i over the eight codes of each word, in fp16 pairs (dot_ptx):
        x_ab packs x' of columns a (low half) and b of the word; c_lo, c_hi are the group's
        fp16x2 subtrahends 1024 + z and -(64 + z)."""
        if _ASM:
            out = tl.inline_asm_elementwise(
                _WORD_PTX, _WORD_CONSTRAINTS,
                [word, x04, x15, x26, x37, c_lo, c_hi],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = (_pair_ref(word, x04, c_lo, 0) + _pair_ref(word, x15, c_lo, 4)
                   + _pair_ref(word, x26, c_lo, 8) + _pair_ref(word, x37, c_lo, 12))
        return out

    @triton.jit
    def _quad_dot(w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2,
                  a3, b3, c3, d3, c_lo, c_hi):
        """_word_dot over a thread's four consecutive words (its 16-byte load) with one
        fp16x2 partial: the four words' x pairs (a_j, b_j, c_j, d_j = x04, x15, x26, x37 of
        word j) share a power of two, so the lanes are added and widened once for 32 codes,
        not once a word (the widening, its FMUL and FFMA had been a fifth of the loop). A
        lane sums 16 products of at most 63 x 2: at most 2016, far inside fp16."""
        if _ASM:
            out = tl.inline_asm_elementwise(
                _QUAD_PTX, _QUAD_CONSTRAINTS,
                [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2,
                 a3, b3, c3, d3, c_lo, c_hi],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = (_word_dot(w0, a0, b0, c0, d0, c_lo, c_hi)
                   + _word_dot(w1, a1, b1, c1, d1, c_lo, c_hi)
                   + _word_dot(w2, a2, b2, c2, d2, c_lo, c_hi)
                   + _word_dot(w3, a3, b3, c3, d3, c_lo, c_hi))
        return out

    @triton.jit
    def _quads(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
        """[A, B, C] -> the four [A, B, C // 4] of words 4j, 4j + 1, 4j + 2, 4j + 3 (a
        thread's 16-byte load holds them, so the split moves nothing)."""
        r = tl.reshape(v, (A, B, C // 4, 2, 2))
        even, odd = tl.split(r)
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3

    @triton.jit
    def _x_pairs(x_base, GROUPS: tl.constexpr, INNER: tl.constexpr, QUAD: tl.constexpr):
        """x's eight elements of each word of the tile, each word's scaled by a power of two
        2^-e that brings its largest into [1, 2) (so the fp16 products cannot overflow, and
        lose nothing to fp16's range), packed in the four fp16 pairs of _word_dot; with 2^e
        and the word's sum of x (for minimums). QUAD: the power of two is the largest of four
        consecutive words' (_quad_dot adds their products in fp16); 2^e and the sum are
        then per four words, [GROUPS, INNER // 4]."""
        x0 = tl.load(x_base).to(tl.float32)
        x1 = tl.load(x_base + 1).to(tl.float32)
        x2 = tl.load(x_base + 2).to(tl.float32)
        x3 = tl.load(x_base + 3).to(tl.float32)
        x4 = tl.load(x_base + 4).to(tl.float32)
        x5 = tl.load(x_base + 5).to(tl.float32)
        x6 = tl.load(x_base + 6).to(tl.float32)
        x7 = tl.load(x_base + 7).to(tl.float32)
        mx = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                   tl.maximum(tl.abs(x2), tl.abs(x3))),
                        tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                   tl.maximum(tl.abs(x6), tl.abs(x7))))
        if QUAD:
            mx = tl.max(tl.reshape(mx, (GROUPS, INNER // 4, 4)), axis=2)
        # exponent bits of the largest: 2^e; 254 - (e + 127) is 2^-e's (0 -> 2^127 x 0 = 0)
        e_bits = mx.to(tl.int32, bitcast=True) & 0x7F800000
        inv = (0x7F000000 - e_bits).to(tl.float32, bitcast=True)
        esc = e_bits.to(tl.float32, bitcast=True)
        if QUAD:   # 2^-e back to each word of its block
            inv = tl.reshape(tl.broadcast_to(inv[:, :, None], (GROUPS, INNER // 4, 4)),
                             (GROUPS, INNER))
        x04 = _half2(x0 * inv, x4 * inv)
        x15 = _half2(x1 * inv, x5 * inv)
        x26 = _half2(x2 * inv, x6 * inv)
        x37 = _half2(x3 * inv, x7 * inv)
        xsum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        if QUAD:
            xsum = tl.sum(tl.reshape(xsum, (GROUPS, INNER // 4, 4)), axis=2)
        return x04, x15, x26, x37, esc, xsum

    @triton.jit
    def _subtrahends(z_ptrs, ZERO_MODE: tl.constexpr):
        """The fp16x2 subtrahends of _word_dot per [BLOCK_N, GROUPS] (1024 + z, -(64 + z)):
        z = 8 (form 0), the group's integer zero point (form 1), 0 (form 2, minimums)."""
        if ZERO_MODE == 1:
            z = tl.load(z_ptrs).to(tl.float32).to(tl.int32).to(tl.uint32)
            lo = _LO_BASE + z
            hi = _HI_BASE + z * 16
            c_lo = lo | (lo << 16)
            c_hi = hi | (hi << 16)
        else:
            zc: tl.constexpr = 8 if ZERO_MODE == 0 else 0
            lo_c: tl.constexpr = _LO_BASE + zc
            hi_c: tl.constexpr = _HI_BASE + zc * 16
            c_lo = tl.full((1, 1), lo_c | (lo_c << 16), tl.uint32)
            c_hi = tl.full((1, 1), hi_c | (hi_c << 16), tl.uint32)
        return c_lo, c_hi

    @triton.jit
    def _tile_dot(acc, cur, t, X, s_rows, z_rows, x_in, g_in, BLOCK_N: tl.constexpr,
                  BLOCK_W: tl.constexpr, GROUPS: tl.constexpr, INNER: tl.constexpr,
                  WPG: tl.constexpr, QUAD: tl.constexpr, ZERO_MODE: tl.constexpr):
        """acc plus tile t's products: its codes `cur` [BLOCK_N, GROUPS, INNER] against x's
        columns, scaled per group. x's elements are loaded, scaled and packed once per word
        for all the rows a thread holds (eight in the main configs), so their cost is
        shared."""
        w0 = t * BLOCK_W
        x04, x15, x26, x37, esc, xsum = _x_pairs(X + t * (BLOCK_W * 8) + x_in, GROUPS, INNER,
                                                 QUAD)
        g_off = ((w0 + g_in) // WPG)[None, :]
        c_lo, c_hi = _subtrahends(z_rows + g_off, ZERO_MODE)
        if QUAD:
            wq0, wq1, wq2, wq3 = _quads(cur, BLOCK_N, GROUPS, INNER)
            a0, a1, a2, a3 = _quads(x04[None, :, :], 1, GROUPS, INNER)
            b0, b1, b2, b3 = _quads(x15[None, :, :], 1, GROUPS, INNER)
            e0, e1, e2, e3 = _quads(x26[None, :, :], 1, GROUPS, INNER)
            d0, d1, d2, d3 = _quads(x37[None, :, :], 1, GROUPS, INNER)
            part = _quad_dot(wq0, wq1, wq2, wq3, a0, b0, e0, d0, a1, b1, e1, d1,
                             a2, b2, e2, d2, a3, b3, e3, d3,
                             c_lo[:, :, None], c_hi[:, :, None])
        else:
            part = _word_dot(cur, x04[None, :, :], x15[None, :, :], x26[None, :, :],
                             x37[None, :, :], c_lo[:, :, None], c_hi[:, :, None])
        s = tl.load(s_rows + g_off).to(tl.float32)[:, :, None]
        acc += part * (s * esc[None, :, :])
        if ZERO_MODE == 2:
            mn = tl.load(z_rows + g_off).to(tl.float32)[:, :, None]
            acc += mn * xsum[None, :, :]
        return acc

    @triton.constexpr_function
    def _float_kind(ty):
        return {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[str(ty)]

    @triton.jit
    def _x_words(X, t, w_flat, BLOCK_W: tl.constexpr):
        """Tile t's x, as the tensor-core form's asm takes it: each of the tile's words'
        elements as four int32 pairs, [1, BLOCK_W] each. Loaded a tile ahead of its
        products, like the weight, by a load of its own in asm: a Triton load of these few
        elements takes a layout of its own and crosses shared memory to the weight tile's
        (4 barriers a loop), where addresses, being arithmetic, are made in the consumer's
        layout. Not pure: it must stay after the kernel's wait on its inputs (PDL). (The
        interpreter's form reads x in its tile step.)"""
        if not _ASM:
            x0, x1, x2, x3 = 0, 0, 0, 0
        else:
            addr = (X + t * (BLOCK_W * 8) + w_flat * 8).to(tl.int64)
            x0, x1, x2, x3 = tl.inline_asm_elementwise(
                "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [addr],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        return x0, x1, x2, x3

    @triton.jit
    def _tile_mma(acc, cur, x0, x1, x2, x3, t, X, SC, ZP, s_rows, z_rows, w_flat,
                  BLOCK_W: tl.constexpr, WPG: tl.constexpr, REPS: tl.constexpr,
                  ZERO_MODE: tl.constexpr):
        """acc [BLOCK_N, BLOCK_W = MMA_WORDS] plus tile t's products in the tensor-core form
        (mma_ptx): one asm block a lane, its `REPS` rows' words and accumulators. The
        interpreter's form adds each word's sum (q - z) x s instead, in the same tensor."""
        g = (t * BLOCK_W) // WPG
        if _ASM:
            ptx: tl.constexpr = mma_ptx(REPS, ZERO_MODE, X.dtype.element_ty == tl.float16,
                                         _float_kind(SC.dtype.element_ty),
                                         _float_kind(ZP.dtype.element_ty))
            cons: tl.constexpr = mma_constraints(REPS, ZERO_MODE)
            s_addr = (s_rows + g).to(tl.int64)
            if ZERO_MODE == 0:
                acc = tl.inline_asm_elementwise(ptx, cons, [cur, acc, s_addr, x0, x1, x2, x3],
                                                dtype=tl.float32, is_pure=False,
                                                pack=4 * REPS)
            else:
                acc = tl.inline_asm_elementwise(ptx, cons, [cur, acc, s_addr,
                                                            (z_rows + g).to(tl.int64),
                                                            x0, x1, x2, x3],
                                                dtype=tl.float32, is_pure=False,
                                                pack=4 * REPS)
        else:
            x_tile = X + t * (BLOCK_W * 8) + w_flat * 8      # [1, BLOCK_W]: word w's x
            s = tl.load(s_rows + g).to(tl.float32)
            if ZERO_MODE == 1:
                z = tl.load(z_rows + g).to(tl.float32)
            else:
                z = 8.0 if ZERO_MODE == 0 else 0.0
            part = tl.zeros(acc.shape, dtype=tl.float32)
            xsum = tl.zeros(x_tile.shape, dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_tile + i).to(tl.float32)
                part += (((cur >> (4 * i)) & 0xF).to(tl.float32) - z) * xi
                xsum += xi
            acc += s * part
            if ZERO_MODE == 2:
                acc += tl.load(z_rows + g).to(tl.float32) * xsum
        return acc

    @triton.jit
    def _tile_step(acc, cur, x0, x1, x2, x3, t, X, SC, ZP, s_rows, z_rows, x_in, g_in, w_flat,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, GROUPS: tl.constexpr,
                   INNER: tl.constexpr, WPG: tl.constexpr, QUAD: tl.constexpr,
                   ZERO_MODE: tl.constexpr, MMA: tl.constexpr):
        """acc plus tile t's products (its words `cur`, [BLOCK_N, BLOCK_W] uint32), in the
        tensor-core form (MMA: the rows a lane holds) or the fp16-pair form."""
        if MMA:
            acc = _tile_mma(acc, cur, x0, x1, x2, x3, t, X, SC, ZP, s_rows, z_rows, w_flat,
                            BLOCK_W, WPG, MMA, ZERO_MODE)
        else:
            acc = _tile_dot(acc, tl.reshape(cur, (BLOCK_N, GROUPS, INNER)), t, X, s_rows,
                            z_rows, x_in, g_in, BLOCK_N, BLOCK_W, GROUPS, INNER, WPG, QUAD,
                            ZERO_MODE)
        return acc

    @autotune(configs=_configs(), key=["N", "K", "G", "ZERO_MODE", "GATE_UP"],
                     prune_configs_by={"early_config_prune": _prune}, behind_lead=True)
    @triton.jit
    def _gemv4_kernel(X, QW, SC, ZP, B, OUT, P, C, N, K, KW,
                      R, NW, NORMED, RES_OUT, stride_rm, stride_nm, stride_rom, eps,
                      G: tl.constexpr, ZERO_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GATE_UP: tl.constexpr, NORM: tl.constexpr,
                      NORM_BLOCK: tl.constexpr,
                      GRID_TICKET: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
                      MMA: tl.constexpr, USE_PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        WPG: tl.constexpr = G // 8
        INNER: tl.constexpr = WPG if WPG < BLOCK_W else BLOCK_W
        GROUPS: tl.constexpr = BLOCK_W // INNER
        # Four words at a time (_quad_dot) where a group holds whole fours of them.
        QUAD: tl.constexpr = INNER % 4 == 0
        INNER_A: tl.constexpr = INNER // 4 if QUAD else INNER
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATE_UP:
            # a merged gate|up weight [2N, K] (gate rows first): the tile's rows alternate
            # gate row c, up row N + c for its BLOCK_N / 2 outputs c, so the two halves of
            # an output come out side by side (split after the sum)
            c_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
            rows = tl.minimum(c_out, N - 1) + (tl.arange(0, BLOCK_N) % 2) * N
        else:
            # Columns past N read row N - 1 (valid memory) and are never stored.
            rows = tl.minimum(cols, N - 1)
        cols_c = rows.to(tl.int64)
        # KW = K / 8 is an argument (not computed here) so that its divisibility by 16 is
        # known and rows of words load as 16-byte vectors.
        n_groups = K // G
        # A tile's words are loaded as [BLOCK_N, BLOCK_W], one row's words contiguous, so a
        # warp's lanes take 4 words each of one row (coalesced 512 bytes) and each thread
        # holds BLOCK_N / num_warps rows; viewed as [BLOCK_N, GROUPS, INNER] after the load.
        # (Loaded in the 3-D shape, the layout put a thread on one row across the tile's
        # groups: four times the x pairs per word through shared memory.)
        w_rows = QW + cols_c[:, None] * KW
        s_rows = SC + cols_c[:, None] * n_groups
        z_rows = ZP + cols_c[:, None] * n_groups
        # word offsets within a tile [GROUPS, INNER], and their first columns of x
        w_in = (tl.arange(0, GROUPS) * INNER)[:, None] + tl.arange(0, INNER)[None, :]
        w_flat = tl.arange(0, BLOCK_W)[None, :]
        g_in = tl.arange(0, GROUPS) * INNER
        x_in = w_in * 8     # word w, nibble i: column 8 w + i
        tiles = KW // (BLOCK_W * SPLIT_K)
        t_lo = pid_k * tiles
        t_hi = t_lo + tiles
        # The first tiles are no kernel's output: under PDL they stream in while the kernel
        # before this one finishes. Two tiles are in flight: the loop takes them in pairs,
        # each loading its successor two ahead before working on its own (the loop is not
        # software-pipelined for loads that feed no tl.dot), and without rotating one
        # buffer into the other, which had cost a move a word.
        # Loads past the program's last tile read that tile again (never used; from L1 or
        # L2): masked, they cost a zeroed register a word every tile (sm_90: +3 % of the
        # loop); unmasked, two extra loads of one tile per program (T + 2 loads for T tiles,
        # 3 for 1). Which is faster is for the GPU to say (PART=s23d).
        last = t_hi - 1
        tile_a = tl.load(w_rows + t_lo * BLOCK_W + w_flat)
        tile_b = tl.load(w_rows + tl.minimum(t_lo + 1, last) * BLOCK_W + w_flat)
        pdl_entry(USE_PDL)
        if MMA:
            acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, GROUPS, INNER_A), dtype=tl.float32)
        # The tensor-core form's x words ride along with the weight tiles, a tile ahead
        # (_x_words); the pair form loads and prepares x inside its tile step.
        if MMA:
            xa0, xa1, xa2, xa3 = _x_words(X, t_lo, w_flat, BLOCK_W)
            xb0, xb1, xb2, xb3 = _x_words(X, tl.minimum(t_lo + 1, last), w_flat, BLOCK_W)
        else:
            xa0, xa1, xa2, xa3 = 0, 0, 0, 0
            xb0, xb1, xb2, xb3 = 0, 0, 0, 0
        for t in range(t_lo, t_hi, 2):
            cur = tile_a.to(tl.uint32, bitcast=True)   # logical shifts
            c0, c1, c2, c3 = xa0, xa1, xa2, xa3
            tile_a = tl.load(w_rows + tl.minimum(t + 2, last) * BLOCK_W + w_flat)
            if MMA:
                xa0, xa1, xa2, xa3 = _x_words(X, tl.minimum(t + 2, last), w_flat, BLOCK_W)
            acc = _tile_step(acc, cur, c0, c1, c2, c3, t, X, SC, ZP, s_rows, z_rows, x_in,
                             g_in, w_flat, BLOCK_N, BLOCK_W, GROUPS, INNER, WPG, QUAD,
                             ZERO_MODE, MMA)
            if t + 1 < t_hi:
                cur = tile_b.to(tl.uint32, bitcast=True)
                c0, c1, c2, c3 = xb0, xb1, xb2, xb3
                tile_b = tl.load(w_rows + tl.minimum(t + 3, last) * BLOCK_W + w_flat)
                if MMA:
                    xb0, xb1, xb2, xb3 = _x_words(X, tl.minimum(t + 3, last), w_flat, BLOCK_W)
                acc = _tile_step(acc, cur, c0, c1, c2, c3, t + 1, X, SC, ZP, s_rows, z_rows,
                                 x_in, g_in, w_flat, BLOCK_N, BLOCK_W, GROUPS, INNER, WPG, QUAD,
                                 ZERO_MODE, MMA)
        if MMA:
            # a row's sum is in each of its quad's four lanes (mma_ptx), which the sum adds
            total = (tl.sum(acc, axis=1) * (0.25 if _ASM else 1.0))[None, :]
        else:
            total = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]     # [1, BLOCK_N]
        offs_m = tl.arange(0, 1)
        is_last = True
        if SPLIT_K > 1:
            # (gate|up: the partials of output block pid_n are its tile's 2 x BLOCK_N / 2 rows)
            n_p = 2 * N if GATE_UP else N
            is_last, total = gemv._split_reduce(total, P, C, pid_n, pid_k, offs_m, cols, 1,
                                                n_p, n_p, SPLIT_K)
        if GATE_UP:
            if is_last:
                gate, up = tl.split(tl.reshape(total, (BLOCK_N // 2, 2)))
                # rounded as F.linear and activation.silu_and_mul round them
                dt = OUT.dtype.element_ty
                gate = gate.to(dt).to(tl.float32)
                up = up.to(dt).to(tl.float32)
                act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
                o_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                tl.store(OUT + o_cols, (act * up).to(dt), mask=o_cols < N)
        elif is_last:
            if HAS_BIAS:
                total += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + cols[None, :], total.to(OUT.dtype.element_ty),
                     mask=cols[None, :] < N)
            if NORM:   # the residual add + RMSNorm after the projection (gemv.py)
                gemv._add_norm_epilogue(OUT, R, NW, NORMED, RES_OUT, C, 1, N, stride_rm,
                                        stride_nm, stride_rom, eps, N, NORM_BLOCK,
                                        GRID_TICKET)


def supported(k: int, group_size: int) -> bool:
    """Whether some tile of this kernel fits K and G (the packed words and whole groups)."""
    return k % 8 == 0 and group_size % 8 == 0 and k % group_size == 0


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              offsets: torch.Tensor | None, zero_mode: int, group_size: int,
              bias: torch.Tensor | None, out: torch.Tensor, *, pdl: bool = False,
              gate_up: bool = False, norm: tuple | None = None,
              _config: dict | None = None) -> torch.Tensor:
    """x [1, K] (contiguous) @ W^T (+ bias) into out [1, N]; the arguments as
    int4_matmul.int4_matmul has checked them. `gate_up`: W is a merged gate|up weight
    [2N, K] (gate rows first) and out [1, N] gets silu(gate) * up, rounded as F.linear and
    activation.silu_and_mul round them (no bias). `pdl`: launch with programmatic dependent
    launch where the GPU has it (kernels/_common.pdl_launch). `norm` (not with gate_up):
    (residual, norm weight, eps, normed out, residual out), the residual add + RMSNorm after
    the product in the same launch (gemv.skinny_matmul_add_norm's epilogue; checked by the
    caller, gemv.check_norm_operands). `_config` (tests) forces one tile config."""
    rows, k = packed.shape[0], packed.shape[1] * 8
    if gate_up and (bias is not None or rows % 2):
        raise ValueError("the fused gate|up GEMV takes an even number of rows and no bias")
    n = rows // 2 if gate_up else rows
    if out.shape[-1] != n:
        raise ValueError(f"out has {out.shape[-1]} columns, the product {n}")
    if gate_up and norm is not None:
        raise ValueError("the fused gate|up GEMV takes no norm epilogue")
    partials, counters = gemv._workspace(x.device)
    norm_args, norm_meta = gemv.norm_epilogue_args(norm, out, n)
    args = (x, packed, scales, offsets if offsets is not None else scales,
            bias if bias is not None else scales, out, partials, counters, n, k, k // 8,
            *norm_args)
    pdl = pdl_launch(x, pdl)
    meta = dict(G=group_size, ZERO_MODE=zero_mode, HAS_BIAS=bias is not None, GATE_UP=gate_up,
                USE_PDL=pdl, launch_pdl=pdl, **norm_meta)
    if _config is None:
        if norm is not None:   # the key's config chosen on the plain product
            gemv.tune_on_plain_product(
                _gemv4_kernel, (n, k, group_size, zero_mode, x.dtype, offsets is None,
                                bias is None, x.device),
                lambda: int4_gemv(x, packed, scales, offsets, zero_mode, group_size, bias,
                                  torch.empty_like(out), pdl=pdl))
        _gemv4_kernel[lambda c: (triton.cdiv(rows, c["BLOCK_N"]), c["SPLIT_K"])](*args, **meta)
        return out
    config = dict(_config)
    warps, stages = config.pop("num_warps", 4), config.pop("num_stages", 1)
    mma = bool(config.pop("MMA", False))
    config["MMA"] = mma_reps(config["BLOCK_N"], warps) if mma else 0
    if not fits(rows, k, group_size, config["BLOCK_N"], config["BLOCK_W"], config["SPLIT_K"],
                warps if mma else 0):
        raise ValueError(f"config {_config} does not fit N={rows}, K={k}, G={group_size}")
    if mma and not mma_operands_ok(x):
        raise ValueError(f"the tensor-core form takes 16-bit, 16-byte aligned x (got {x.dtype})")
    _gemv4_kernel.fn[(triton.cdiv(rows, config["BLOCK_N"]), config["SPLIT_K"])](
        *args, **meta, **config, num_warps=warps, num_stages=stages)
    return out
