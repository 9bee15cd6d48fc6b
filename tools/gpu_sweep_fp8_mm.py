"""FP8-weight products at decode batch sizes on the GPU: folio's Triton kernel
(kernels/fp8_matmul.py, every config forced, W8A8 and W8A16) against torch._scaled_mm and the
bf16 cuBLAS product, at Llama-3-8B's projection shapes.

    python tools/gpu_sweep_fp8_mm.py [--m 2,8,16,32,64] [--json OUT]

Per projection and row count it prints the best config of each arithmetic and the times of:
  bf16       folio's Linear (cuBLAS past one row)
  fp8-now    EightBitLinear as it runs now (activation quantization + the product)
  quant      the per-token activation quantization alone
  scaled-mm  torch._scaled_mm alone (activations quantized already)
  tri8       fp8_matmul on quantized activations (W8A8), each config
  tri16      fp8_matmul on the 16-bit activations (W8A16), each config
  tri8-chosen / tri16-chosen  the config the kernel chooses (choose_config)
Each time is a CUDA graph of back-to-back calls on copies of the weight larger than the L2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.bench.roofline import measure_copy_bandwidth  # noqa: E402
from folio.model.kernels import fp8_matmul as fm  # noqa: E402
from folio.model.kernels.act_quant import quantize_activations  # noqa: E402
from folio.model.layers import Linear  # noqa: E402
from folio.model.quant.eight_bit_linear import EightBitLinear  # noqa: E402
from folio.model.quant.formats import quantize_fp8_per_channel  # noqa: E402
from tools.gpu_check_gemv import graph_time_us  # noqa: E402
from tools.gpu_check_quant import SHAPES, _copies  # noqa: E402

CUDA = torch.device("cuda")
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): the configs swept (the kernel's
# choose_config picks among the winners)
CANDIDATES = [
    (16, 32, 256, 1, 4, 4), (16, 64, 256, 1, 4, 4), (16, 64, 128, 1, 4, 6),
    (16, 128, 128, 1, 4, 4), (16, 32, 512, 1, 4, 3), (16, 16, 512, 1, 4, 4),
    (16, 32, 256, 2, 4, 4), (16, 64, 256, 2, 4, 4), (16, 32, 256, 4, 4, 4),
    (32, 64, 256, 1, 4, 4), (32, 128, 128, 1, 4, 4),
    (64, 64, 256, 1, 4, 4), (64, 128, 128, 1, 4, 4), (64, 128, 256, 1, 8, 3),
    (64, 64, 128, 2, 4, 4),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="2,8,16,32,64")
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    wanted = set(args.shapes.split(","))
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth (best of 4 GiB copies): {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        w = torch.randn(n, k, device=CUDA) * 0.02
        c16, c8 = _copies(n, k, 2), _copies(n, k, 1)
        bf16 = [Linear(k, n, bias=False, device=CUDA, dtype=torch.bfloat16) for _ in range(c16)]
        fp8 = [EightBitLinear(quantize_fp8_per_channel(w), "fp8") for _ in range(c8)]
        del w
        for m in ms:
            x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
            xq, xs = quantize_activations(x, fm.FP8_DTYPE)
            ref = fp8[0].reference(x.float()).to(torch.bfloat16).float()
            cases: dict[str, tuple[list, float]] = {
                "bf16": ([lambda l=l: l(x) for l in bf16], 2.0),
                "fp8-now": ([lambda l=l: l(x) for l in fp8], 1.0),
                "quant": ([lambda: quantize_activations(x, fm.FP8_DTYPE)] * 8, 0.0),
                "scaled-mm": ([lambda l=l: torch._scaled_mm(xq, l.codes.t(), scale_a=xs,
                                                            scale_b=l.scale.view(1, -1),
                                                            out_dtype=torch.bfloat16)
                               for l in fp8], 1.0),
                "tri8-chosen": ([lambda l=l: fm.fp8_matmul(xq, l.codes, l.scale, xs,
                                                         out_dtype=torch.bfloat16)
                               for l in fp8], 1.0),
                "tri16-chosen": ([lambda l=l: fm.fp8_matmul(x, l.codes, l.scale) for l in fp8],
                               1.0),
            }
            mb = fm.row_bucket(m)
            for bm, bn, bk, sk, warps, stages in CANDIDATES:
                if not fm.fits(mb, n, k, bm, bn, bk, sk):
                    continue
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps,
                           num_stages=stages)
                tag = f"{bm}x{bn}x{bk}s{sk}w{warps}p{stages}"
                cases[f"tri8/{tag}"] = ([lambda l=l, c=cfg: fm.fp8_matmul(
                    xq, l.codes, l.scale, xs, out_dtype=torch.bfloat16, _config=c)
                    for l in fp8], 1.0)
                cases[f"tri16/{tag}"] = ([lambda l=l, c=cfg: fm.fp8_matmul(
                    x, l.codes, l.scale, _config=c) for l in fp8], 1.0)
            best: dict[str, tuple[float, str]] = {}
            for label, (fns, bpw) in cases.items():
                try:
                    out = fns[0]()
                    if label.startswith("tri"):
                        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                        if not err < 0.05:
                            print(f"{name:8s} M={m:4d} {label:28s} WRONG rel err {err:.3g}",
                                  flush=True)
                            continue
                    us = graph_time_us(fns)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"{name:8s} M={m:4d} {label:28s} ERR {exc!r}"[:300], flush=True)
                    continue
                frac = n * k * bpw / (us * 1e-6) / bandwidth
                rows.append({"proj": name, "N": n, "K": k, "M": m, "kind": label, "us": us,
                             "fraction_of_copy_bw": frac})
                family = label.split("/")[0]
                if "/" in label and (family not in best or us < best[family][0]):
                    best[family] = (us, label)
                if "/" not in label:
                    print(f"{name:8s} M={m:4d} {label:28s} {us:8.1f}us {100 * frac:5.1f}%",
                          flush=True)
            for family, (us, label) in best.items():
                frac = n * k / (us * 1e-6) / bandwidth
                print(f"{name:8s} M={m:4d} best {label:23s} {us:8.1f}us {100 * frac:5.1f}%",
                      flush=True)
        del bf16, fp8
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
