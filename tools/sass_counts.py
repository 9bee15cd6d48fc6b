"""Compile folio's paged attention kernels and one-row quantized GEMVs for sm_90 on this
machine (no GPU needed: Triton's own compiler and ptxas) and count their SASS instructions: a
first look at what a kernel change does to the code before spending device time on it.

    python tools/sass_counts.py [--kernel decode|decode-split|varlen] [--kv bf16|fp8|fp8-pairs]
        [--block-n 32 --warps 2 --stages 2] [--block-m 128] [--dump /tmp/k]
    python tools/sass_counts.py --kernel int4-gemv --block-n 128 --warps 2
        [--block-w 128 --pairs]      (the 4-bit GEMV's fp16-pair form)

Prints the instruction total, each loop's length (the part that runs per tile) and the counts
that told the FP8 cache's story (session 30):
byte-wide shared-memory loads (LDS.U8), ldmatrix (LDSM), the e4m3 pair conversion, mma.sync.
Integer arguments are compiled as the GPU run specializes them (strides divisible by 16).
`--dump` writes the TTGIR, PTX and SASS next to the given prefix.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from folio.model.attention import triton_kernels as tk

_POINTERS = {"Q": "*bf16", "O": "*bf16", "M_PART": "*fp32", "L_PART": "*fp32",
             "ACC_PART": "*fp32", "CNT": "*i32", "SEQ": "*i32", "BT": "*i32",
             "K_SCALE": "*fp32", "V_SCALE": "*fp32", "SINKS": "*bf16", "QSL": "*i32",
             "SKIP": "*i32"}
_FLOATS = {"qk_scale", "soft_cap"}
_SHOWN = ("LDS.U8", "LDSM.16.M88.4", "LDSM.16.MT88.4", "F2FP.F16.E4M3.UNPACK_B",
          "HMMA.16816.F32", "HMMA.16816.F32.BF16", "PRMT", "LDGSTS.E.BYPASS.128")


def compile_sm90(fn, constexprs: dict, kv_type: str, num_warps: int, num_stages: int):
    """`fn` (a @triton.jit function) compiled for sm_90 with these constexprs."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "KV" or name in _POINTERS:
            sig[name] = kv_type if name == "KV" else _POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name != "stride_bt":  # as the launch specializes
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_gemv4(block_n: int, block_w: int, split_k: int, warps: int, *, mma: bool,
                  zero_mode: int = 0, group: int = 128, gate_up: bool = False):
    """The one-row 4-bit GEMV of kernels/int4_gemv.py compiled for sm_90 as a launch over
    bf16 x specializes it."""
    from folio.model.kernels import int4_gemv as ig
    fn = ig._gemv4_kernel.fn
    pointers = {"X": "*bf16", "QW": "*i32", "SC": "*bf16", "ZP": "*bf16",
                "B": "*bf16", "OUT": "*bf16", "P": "*fp32", "C": "*i32", "R": "*bf16",
                "NW": "*bf16", "NORMED": "*bf16", "RES_OUT": "*bf16"}
    consts = dict(G=group, ZERO_MODE=zero_mode, HAS_BIAS=False, GATE_UP=gate_up, NORM=False,
                  NORM_BLOCK=16, GRID_TICKET=False, BLOCK_N=block_n,
                  BLOCK_W=block_w, SPLIT_K=split_k, USE_PDL=True,
                  MMA=ig.mma_reps(block_n, warps) if mma else 0)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in ("N", "K", "KW"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 1})


def sass_of(kernel) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    return collections.Counter(re.findall(
        r"/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass))


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of each loop (from a backward branch's target to the branch), in
    program order."""
    lines = [l for l in sass.split("\n") if re.search(r"/\*[0-9a-f]{4,5}\*/", l)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,5})\*/", l).group(1), 16) for l in lines]
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addr[i]:
            start = int(m.group(1), 16)
            loops.append([l for l, a in zip(lines, addr) if start <= a <= addr[i]])
    return loops


def loop_lengths(sass: str) -> list[int]:
    """The instruction count of each loop: what a kernel spends per iteration, which its
    total (prologue and epilogue included) can misstate."""
    return [len(body) for body in loop_bodies(sass)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="decode",
                    choices=["decode", "decode-split", "varlen", "int4-gemv"])
    ap.add_argument("--block-w", type=int, default=16, help="GEMV tile words")
    ap.add_argument("--pairs", action="store_true", help="4-bit GEMV: the fp16-pair form")
    ap.add_argument("--kv", default="fp8-pairs", choices=["bf16", "fp8", "fp8-pairs"])
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--heads-per-kv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    if args.kernel == "int4-gemv":
        kernel = compile_gemv4(args.block_n, args.block_w, 1, args.warps, mma=not args.pairs)
        sass = sass_of(kernel)
        ops = opcode_counts(sass)
        print(f"{args.kernel} {args.block_n}x{args.block_w} warps={args.warps}"
              f"{' pairs' if args.pairs else ' mma'}: {sum(ops.values())} instructions; "
              f"loops {loop_lengths(sass)} (two tiles an iteration)")
        print("  " + "  ".join(f"{op} {n}" for op, n in ops.most_common(12)))
        return
    fp8, pairs = args.kv != "bf16", args.kv == "fp8-pairs"
    kv_type = "*fp8e4nv" if fp8 else "*bf16"
    g, d = args.heads_per_kv, args.head_dim
    common = dict(G=g, D=d, D_PAD=max(16, tk._next_pow2(d)), BLOCK_SIZE=16, SLIDING=False,
                  DOT_PREC="tf32", SOFTCAP=False, HAS_SINKS=False, FP8=fp8,
                  BLOCK_N=args.block_n)
    if args.kernel == "varlen":
        fn = tk._varlen_kernel.fn
        consts = dict(common, G_PAD=tk._next_pow2(g), HAS_SKIP=False, BLOCK_M=args.block_m,
                      PAIRS=pairs, CVT_ASM=pairs, E5M2=False)
    else:
        fn = tk._decode_kernel.fn
        split = args.kernel == "decode-split"
        consts = dict(common, G_M=max(16, tk._next_pow2(g)), USE_SPLITS=split,
                      FUSED_MERGE=split, G_P=tk._next_pow2(g), S_CHUNK=16, USE_PDL=True,
                      PAIRS=pairs, CVT_ASM=pairs, E5M2=False)
    kernel = compile_sm90(fn, consts, kv_type, args.warps, args.stages)
    sass = sass_of(kernel)
    ops = opcode_counts(sass)
    print(f"{args.kernel} kv={args.kv} BLOCK_N={args.block_n} warps={args.warps} "
          f"stages={args.stages}: {sum(ops.values())} instructions, shared "
          f"{kernel.metadata.shared} B; loops {loop_lengths(sass)}")
    print("  " + "  ".join(f"{op} {ops.get(op, 0)}" for op in _SHOWN))
    if args.dump:
        for ext, text in (("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]),
                          ("sass", sass)):
            with open(f"{args.dump}.{ext}", "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
