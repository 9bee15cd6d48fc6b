"""Time folio's CPU kernels: the quantized matmuls (q4_matmul, int8_matmul) and paged attention.

    python tools/bench_cpu_kernels.py [--threads 1] [--march native] [--rows 1 4 32 33 64]
        [--contexts 512 2048 8192]  (an empty list skips that part)

matmuls: SmolLM2-135M's LM head (49152 x 576) and an MLP projection (1536 x 576), per row
count of x: the median of --iters calls after warm-up, milliseconds, and the GFLOP/s. The q4
weights are random codes of one plane (as Q4_0/Q4_1 load). Rows 32 and 33 straddle kTileRows
(weight_tiles.h): the blocked kernel below it, tiles of W and torch's GEMM from it on.
attention: one layer of one decoding request at SmolLM2's shape (9 query heads, 3 KV heads,
head_dim 64) over a context of N tokens in a float32 cache of 16-token blocks, shuffled.
--march builds the extension for another instruction set (x86-64 = the portable loops,
x86-64-v3 = AVX2 + FMA) to compare branches on one machine.
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


def _matmuls(ext, rows: list[int], iters: int, gen: torch.Generator) -> None:
    print(f"{'shape':8} {'kernel':6} {'rows':>4} {'ms':>9} {'GFLOP/s':>8}")
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8, generator=gen)
        scale = torch.rand(1, n, k // 32, generator=gen) * 0.02
        zero = torch.randn(1, n, k // 32, generator=gen) * 0.01
        i8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        row_scale = torch.rand(n, 1, generator=gen) * 0.01
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for kernel, fn in (("q4", lambda: ext.q4_matmul(x, codes, scale, zero)),
                               ("int8", lambda: ext.int8_matmul(x, i8, row_scale))):
                ms = _time_ms(fn, iters)
                print(f"{name:8} {kernel:6} {m:>4} {ms:>9.3f} {2 * m * n * k / ms / 1e6:>8.1f}")


def _attention(ext, contexts: list[int], iters: int, gen: torch.Generator) -> None:
    H, KVH, D, bs = 9, 3, 64, 16
    print(f"{'attention':10} {'context':>7} {'ms':>9} {'GFLOP/s':>8}")
    for ctx in contexts:
        blocks = -(-ctx // bs)
        cache = torch.randn(2, blocks + 1, bs, KVH, D, generator=gen)
        table = torch.randperm(blocks + 1, generator=gen)[:blocks].view(1, blocks)
        pos = ctx - 1
        slots = torch.tensor([int(table[0, pos // bs]) * bs + pos % bs])
        q = torch.randn(1, H, D, generator=gen)
        k = torch.randn(1, KVH, D, generator=gen)
        v = torch.randn(1, KVH, D, generator=gen)
        out = torch.empty(1, H, D)
        qsl, lens = torch.tensor([0, 1]), torch.tensor([ctx])
        ones = torch.ones(KVH)

        def step() -> None:
            ext.paged_attention(out, q, k, v, cache, slots, table, qsl, lens, D ** -0.5, 0,
                                ones, ones, 0.0, None)

        ms = _time_ms(step, iters)
        print(f"{'decode':10} {ctx:>7} {ms:>9.3f} {4 * H * ctx * D / ms / 1e6:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--march", default="native")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16, 32, 33, 64])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 8192])
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = (cpu_kernels.extension() if args.march == "native"
           else cpu_kernels._build(march=args.march, simd_only=True))
    gen = torch.Generator().manual_seed(0)
    print(f"threads={args.threads} march={args.march}")
    if args.rows:
        _matmuls(ext, args.rows, args.iters, gen)
    if args.contexts:
        _attention(ext, args.contexts, args.iters, gen)


if __name__ == "__main__":
    main()
