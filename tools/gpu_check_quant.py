"""GPU timing of the quantized linears against bf16, at Llama-3-8B's projection shapes.

Run on the GPU machine from the repository root:
    python tools/gpu_check_quant.py [--m 1,4,8,16,64,256,4096] [--json OUT]

For each projection (qkv, o, gate_up, down) and row count M, the time per call of:
  bf16      folio's Linear (skinny GEMV at M=1, cuBLAS otherwise)
  fp8       EightBitLinear, FP8 W8A8 (skinny GEMV to M=8; per-token activation quantization +
            torch._scaled_mm beyond)
  fp8-mm    torch._scaled_mm alone (activations already quantized: cuBLASLt's share)
  fp8-fast  the same with use_fast_accum (Hopper's FP8 accumulation without promotion)
  fp8-gu    (gate_up, M=1) the merged FP8 gate|up with SiLU-and-mul fused in the GEMV
  int8      EightBitLinear, INT8 W8A8 (skinny GEMV to M=8; torch._int_mm beyond)
  int4      GroupQuantLinear, W4A16 group 128 (folio's Triton kernel; dequantize + cuBLAS from
            DEQUANT_MIN_ROWS rows)
  int4-tri  the Triton kernel alone at every M (to place DEQUANT_MIN_ROWS)
  tinygemm  torch's _weight_int4pack_mm (group 128), the issue's baseline, where it runs
With --sweep, every config of the one-row GEMVs (4-bit: kernels/int4_gemv.py; FP8: the
skinny GEMV's one-row configs) is timed forced, at M=1, as "int4/<config>" and "fp8/<config>".
Each time is a CUDA graph of back-to-back calls, each on its own copy of the weights (larger
than the L2 together, as a model's layers are). The kernels launch as the layers launch them
(PDL on Hopper: each call's first tiles stream in while the one before finishes), forced
configs too, so that their times compare with the layers' rows. Prints µs and the weight
bytes per second as a fraction of the best large-copy bandwidth
(folio.bench.roofline.measure_copy_bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.bench.roofline import measure_copy_bandwidth  # noqa: E402
from folio.model.layers import Linear  # noqa: E402
from folio.model.quant.eight_bit_linear import EightBitLinear  # noqa: E402
from folio.model.quant.formats import (EightBitWeight, Int4Weight, pack_rows,  # noqa: E402
                                       quantize_fp8_per_channel)
from folio.model.quant.group_linear import GroupQuantLinear  # noqa: E402
from folio.model.kernels import gemv, int4_gemv  # noqa: E402
from folio.model.kernels.int4_matmul import int4_matmul  # noqa: E402
from tools.gpu_check_gemv import graph_time_us  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]
CUDA = torch.device("cuda")
# One-row FP8 candidates beyond the kernel's own list (--sweep times them too): a whole
# 4096-wide row per tile (every load issued at once, no loop), more warps, split-K for down.
EXTRA_FP8_CONFIGS = [
    (2, 4096, 1, 0, 4, 1), (4, 4096, 1, 0, 8, 1), (8, 4096, 1, 0, 8, 1),
    (8, 4096, 1, 0, 16, 1), (16, 2048, 1, 0, 8, 2), (16, 1024, 1, 0, 4, 3),
    (8, 1024, 1, 0, 4, 3), (32, 512, 1, 0, 4, 3), (8, 2048, 2, 0, 8, 2),
    (4, 4096, 2, 0, 8, 1), (8, 2048, 4, 0, 8, 2), (16, 1024, 2, 0, 4, 3),
]


def _copies(n: int, k: int, bytes_per_weight: float) -> int:
    """Enough copies of a weight to overflow the L2 (several hundred MB in all)."""
    return max(2, min(16, int(600e6 // (n * k * bytes_per_weight))))


def _int4(n: int, k: int) -> Int4Weight:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=CUDA)
    s = (torch.rand(n, k // 128, device=CUDA) * 0.004 + 0.001).to(torch.bfloat16)
    return Int4Weight(pack_rows(q), s, None, 128)


# The one-row layers' autotuners, by the sweep's row label.
_TUNERS = {"int4": lambda: int4_gemv._gemv4_kernel, "fp8": lambda: gemv._skinny_kernel}


def _int4_label(bn: int, bw: int, sk: int, warps: int, mma: bool) -> str:
    return f"int4/{bn}x{bw}s{sk}w{warps}{'mma' if mma else ''}"


def _fp8_label(bn: int, bk: int, sk: int, warps: int, stages: int) -> str:
    return f"fp8/{bn}x{bk}s{sk}w{warps}p{stages}"


def _tuned_label(kind: str, config) -> str:
    """A config as the sweep labels its forced rows."""
    k, w = config.kwargs, config.num_warps
    if kind == "int4":
        return _int4_label(k["BLOCK_N"], k["BLOCK_W"], k["SPLIT_K"], w, bool(k["MMA"]))
    return _fp8_label(k["BLOCK_N"], k["BLOCK_K"], k["SPLIT_K"], w, config.num_stages)


def _print_tuning(name: str, label: str) -> None:
    """The autotuner's own timings of the shape it has just tuned for a layer's row (each
    config alone, the L2 flushed: triton's do_bench), its best eight, to set beside the same
    configs' forced rows (back to back under PDL in a graph): whether the two rank alike.
    Nothing when the choice came from the disk cache."""
    tuner = _TUNERS.get(label)
    timings = getattr(tuner(), "configs_timings", None) if tuner else None
    if not timings:
        return
    best = sorted(timings.items(), key=lambda kv: kv[1][0])[:8]
    print(f"tuned {name:8s} {label}: " + ", ".join(
        f"{_tuned_label(label, c)} {t[0] * 1e3:.1f}us" for c, t in best), flush=True)
    tuner().configs_timings = None     # printed once


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,4,8,16,64,256,4096")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated label prefixes to time (e.g. int4,fp8): the rest "
                             "are skipped, to keep a device call short")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    kinds = tuple(args.kinds.split(",")) if args.kinds else ()
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth (best of 4 GiB copies): {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device=CUDA) * 0.02
        c16, c8, c4 = _copies(n, k, 2), _copies(n, k, 1), _copies(n, k, 0.5)
        bf16 = [Linear(k, n, bias=False, device=CUDA, dtype=torch.bfloat16) for _ in range(c16)]
        fp8 = [EightBitLinear(quantize_fp8_per_channel(w), "fp8") for _ in range(c8)]
        scale = w.abs().amax(dim=1) / 127
        int8 = [EightBitLinear(EightBitWeight(torch.round(w / scale[:, None]).to(torch.int8),
                                              scale), "int8") for _ in range(c8)]
        int4 = [GroupQuantLinear(_int4(n, k)) for _ in range(c4)]
        tiny = []
        try:
            wq = torch.randint(0, 16, (n, k), dtype=torch.int32, device=CUDA)
            packed = torch._convert_weight_to_int4pack(
                (wq[:, ::2] << 4 | wq[:, 1::2]).to(torch.uint8), 8)
            sz = torch.rand(k // 128, n, 2, device=CUDA, dtype=torch.bfloat16)
            tiny = [(packed.clone(), sz) for _ in range(c4)]
        except Exception as exc:  # noqa: BLE001 - a baseline only
            print(f"tinygemm unavailable: {exc!r}", flush=True)
        del w
        for m in ms:
            x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
            xq = torch.randn(m, k, device=CUDA).to(torch.float8_e4m3fn)
            xs = torch.ones(m, 1, device=CUDA)
            cases = {
                "bf16": ([lambda l=l: l(x) for l in bf16], 2.0),
                "fp8": ([lambda l=l: l(x) for l in fp8], 1.0),
                "fp8-mm": ([lambda l=l: torch._scaled_mm(xq, l.codes.t(), scale_a=xs,
                                                         scale_b=l.scale.view(1, -1),
                                                         out_dtype=torch.bfloat16)
                            for l in fp8], 1.0) if m >= 16 else None,
                "fp8-fast": ([lambda l=l: torch._scaled_mm(xq, l.codes.t(), scale_a=xs,
                                                           scale_b=l.scale.view(1, -1),
                                                           out_dtype=torch.bfloat16,
                                                           use_fast_accum=True)
                              for l in fp8], 1.0) if m >= 16 else None,
                "fp8-gu": ([lambda l=l: l.gate_up_silu(x, None) for l in fp8], 1.0)
                if m == 1 and name == "gate_up" else None,
                "int8": ([lambda l=l: l(x) for l in int8], 1.0),
                "int4": ([lambda l=l: l(x) for l in int4], 0.5 + 2 / 128),
                "int4-gu": ([lambda l=l: l.gate_up_silu(x, None) for l in int4], 0.5 + 2 / 128)
                if m == 1 and name == "gate_up" else None,
                "int4-tri": ([lambda l=l: int4_matmul(x, l.codes, l.scales, None, 128, pdl=True)
                              for l in int4], 0.5 + 2 / 128),
                "tinygemm": ([lambda p=p: torch._weight_int4pack_mm(x, p[0], 128, p[1])
                              for p in tiny], 0.5 + 4 / 128) if tiny else None,
            }
            if args.sweep and m == 1:
                for bn, bw, sk, w_, st, mma in int4_gemv._CONFIGS:
                    if int4_gemv.fits(n, k, 128, bn, bw, sk, w_ if mma else 0):
                        cfg = dict(BLOCK_N=bn, BLOCK_W=bw, SPLIT_K=sk, num_warps=w_,
                                   num_stages=st, MMA=mma)
                        cases[_int4_label(bn, bw, sk, w_, mma)] = (
                            [lambda l=l, c=cfg: int4_matmul(x, l.codes, l.scales, None, 128,
                                                            pdl=True, _config=c)
                             for l in int4],
                            0.5 + 2 / 128)
                old = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, DOT=1, UNPACK=0,
                           num_warps=4, num_stages=4)
                cases["int4/tensor-core-16-rows"] = (
                    [lambda l=l: int4_matmul(x, l.codes, l.scales, None, 128, _config=old)
                     for l in int4], 0.5 + 2 / 128)
                for bn, bk, sk, dot, w_, st in gemv._FULL_CONFIGS + EXTRA_FP8_CONFIGS:
                    if dot or (sk > 1 and n > gemv._SPLIT_MAX_N) or bk > k:
                        continue
                    cfg = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, DOT=0, num_warps=w_,
                               num_stages=st)
                    cases[_fp8_label(bn, bk, sk, w_, st)] = (
                        [lambda l=l, c=cfg: gemv.skinny_matmul(x, l.codes, scale=l.scale,
                                                               pdl=True, _config=c)
                         for l in fp8], 1.0)
            for label, case in cases.items():
                if case is None or (kinds and not label.startswith(kinds)):
                    continue
                fns, bpw = case
                try:
                    us = graph_time_us(fns)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"{name:8s} M={m:5d} {label:24s} ERR {exc!r}"[:300], flush=True)
                    continue
                frac = n * k * bpw / (us * 1e-6) / bandwidth
                flops = 2 * m * n * k / (us * 1e-6)
                rows.append({"proj": name, "N": n, "K": k, "M": m, "kind": label, "us": us,
                             "fraction_of_copy_bw": frac, "tflops": flops / 1e12})
                print(f"{name:8s} M={m:5d} {label:24s} {us:8.1f}us {100 * frac:5.1f}% "
                      f"{flops / 1e12:6.1f}TF", flush=True)
                if args.sweep and m == 1:
                    _print_tuning(name, label)
        del bf16, fp8, int8, int4, tiny
        torch.cuda.empty_cache()
    if args.sweep:
        # What the autotuners chose for the layers' rows, to set beside the forced configs'
        # times (session 32: the narrow projections' choices were 9-24 % slower than the
        # best forced config under PDL).
        for label, tuner in (("int4_gemv", int4_gemv._gemv4_kernel),
                             ("skinny", gemv._skinny_kernel),
                             ("skinny_gate_up", gemv._skinny_gate_up_kernel)):
            for key, config in getattr(tuner, "cache", {}).items():
                print(f"chosen {label} {key}: {config}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
