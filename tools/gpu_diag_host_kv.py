"""The host KV tier's load on a GPU, apart from the engine: the pinned host-to-device copy
bandwidth of one large range, then HostKVPool.load of a Llama-3-8B-shaped 100-block prefix
(200 MB) from consecutive and from scattered host slots, waited for in full. Says whether
the load is bound by PCIe or by the number of copies."""
from __future__ import annotations

import random

import torch

from folio.worker.host_kv_pool import HostKVPool


def _time(fn, iters: int = 5) -> float:
    best = float("inf")
    for _ in range(iters + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    nbytes = 200 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t = _time(lambda: dev.copy_(host, non_blocking=True))
    print(f"pinned H2D, one 200 MiB copy: {t * 1e3:.2f} ms, {nbytes / t / 1e9:.1f} GB/s")
    for piece in (64 << 10, 2 << 20):
        n = nbytes // piece
        t = _time(lambda: [dev[i * piece:(i + 1) * piece].copy_(host[i * piece:(i + 1) * piece],
                                                                  non_blocking=True)
                           for i in range(n)])
        print(f"pinned H2D, {n} copies of {piece >> 10} KiB: {t * 1e3:.2f} ms, "
              f"{nbytes / t / 1e9:.1f} GB/s")
    del host, dev
    # Llama-3-8B: 32 layers of [planes 2, blocks, 16, 8 heads, 128] bf16
    caches = [torch.zeros((2, 600, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
              for _ in range(32)]
    pool = HostKVPool(caches, 400)
    moved = 100 * HostKVPool.bytes_per_slot(caches)
    rng = random.Random(0)
    for name, slots in (("consecutive", list(range(100))),
                        ("scattered", rng.sample(range(400), 100))):
        pairs = list(zip(slots, range(200, 300)))

        def load():
            pool.load(caches, pairs).wait_all()
        t = _time(load)
        print(f"HostKVPool.load, 100 blocks from {name} slots: {t * 1e3:.2f} ms, "
              f"{moved / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
