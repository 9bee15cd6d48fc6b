"""Time folio's CPU matmul kernels (q4_matmul, int8_matmul) at the default model's shapes.

    python tools/bench_cpu_matmul.py [--threads 1] [--march native] [--rows 1 4 8 16 32 33 64]

SmolLM2-135M's LM head (49152 x 576) and an MLP projection (1536 x 576), per row count of x:
the median of --iters calls after warm-up, milliseconds, and the GFLOP/s it comes to. The
q4 weights are random codes of one plane (as Q4_0/Q4_1 load); --march builds the extension for
another instruction set (`x86-64` = the portable loops, `x86-64-v3` = AVX2 + FMA) to compare
branches on one machine. Rows 32 and 33 straddle kTileRows (weight_tiles.h): the blocked kernel
below it, tiles of W and torch's GEMM from it on.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio.model import cpu_kernels

SHAPES = {"lm_head": (49152, 576), "mlp": (1536, 576)}


def _time_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--march", default="native")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 33, 64])
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_kernels._build(march=args.march, matmuls_only=args.march != "native")
    gen = torch.Generator().manual_seed(0)
    print(f"threads={args.threads} march={args.march}")
    print(f"{'shape':8} {'kernel':6} {'rows':>4} {'ms':>9} {'GFLOP/s':>8}")
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8, generator=gen)
        scale = torch.rand(1, n, k // 32, generator=gen) * 0.02
        zero = torch.randn(1, n, k // 32, generator=gen) * 0.01
        i8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        row_scale = torch.rand(n, 1, generator=gen) * 0.01
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            for kernel, fn in (("q4", lambda: ext.q4_matmul(x, codes, scale, zero)),
                               ("int8", lambda: ext.int8_matmul(x, i8, row_scale))):
                ms = _time_ms(fn, args.iters)
                print(f"{name:8} {kernel:6} {m:>4} {ms:>9.3f} {2 * m * n * k / ms / 1e6:>8.1f}")


if __name__ == "__main__":
    main()
