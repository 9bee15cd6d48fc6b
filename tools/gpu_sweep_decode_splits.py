"""Sweep the decode attention kernel's split count and tile config on the GPU, per (batch,
context), to choose the split policy (`triton_kernels.choose_num_splits`).

Each (splits, config) is timed as the engine runs it: a CUDA graph of back-to-back decode calls
(attention + merge, PDL on), each on a different layer's cache so that K/V come from memory,
not the L2 (enough caches for >= 256 MiB of K/V, as many as 32 "layers"). Prints, per case,
the best (splits, config), the current policy's pick under the autotuner's config (which it
names: the autotuner tunes once per key, at the first shape it meets, so a sweep over several
shapes shows that shape's pick everywhere), and µs per call; `--json` writes every timing.

    python tools/gpu_sweep_decode_splits.py [--batches 1,4,16,64] [--ctx 128,512,2048,8192]
        [--kv-dtype bf16|fp8] [--heads 32 --kv-heads 8 --head-dim 128] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from folio.model.attention import triton_kernels as tk

# (BLOCK_N, num_warps, num_stages). The 256-key tiles are not among the autotuner's: they are
# here to see whether an FP8 cache (half the bytes a tile of keys) wants more keys in flight.
CONFIGS = [(16, 2, 2), (16, 4, 2), (32, 2, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3),
           (128, 4, 2), (128, 8, 3), (256, 4, 2), (256, 8, 2), (256, 8, 3)]
SPLITS = [1, 2, 4, 8, 16, 32]
BLOCK = 16


def graph_us(fn, calls: int) -> float:
    """µs per call: a graph of `calls` calls, replayed 20 times after 3 untimed replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--ctx", default="128,256,512,1024,2048,4096,8192")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    kv_dt = torch.float8_e4m3fn if args.kv_dtype == "fp8" else dt
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for batch in [int(x) for x in args.batches.split(",")]:
        for ctx in [int(x) for x in args.ctx.split(",")]:
            pages = math.ceil(ctx / BLOCK)
            per_layer = 2 * batch * pages * BLOCK * kvh * d * (1 if kv_dt != dt else 2)
            layers = max(2, min(32, math.ceil((256 << 20) / per_layer)))
            caches = [torch.randn(2, batch * pages, BLOCK, kvh, d, device=dev,
                                  dtype=dt).to(kv_dt) for _ in range(layers)]
            bt = torch.randperm(batch * pages, device=dev,
                                dtype=torch.int32).view(batch, pages)
            seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
            q = torch.randn(batch, h, d, device=dev, dtype=dt)
            out = torch.empty_like(q)
            ref = tk.paged_attention_decode(q, caches[0], seq_lens, bt, d ** -0.5, num_splits=1,
                                            _config={"BLOCK_N": 64}).float()
            timings = {}
            for splits in SPLITS:
                for bn, w, st in CONFIGS:
                    cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}

                    def call(i, splits=splits, cfg=cfg):
                        tk.paged_attention_decode(q, caches[i % layers], seq_lens, bt,
                                                  d ** -0.5, num_splits=splits, out=out,
                                                  pdl=True, _config=cfg)
                    try:
                        call(0)
                        torch.cuda.synchronize()
                        err = (out.float() - ref).abs().max().item()
                        assert err < 2e-2, f"splits {splits} {cfg}: max error {err}"
                        timings[(splits, bn, w, st)] = graph_us(call, 2 * layers)
                    except Exception as e:  # noqa: BLE001 - a config that fails is reported
                        print(f"b={batch} ctx={ctx} splits={splits} {cfg}: {e}"[:300])
            chosen = tk.choose_num_splits(batch, kvh, ctx, num_sms=sms)

            def auto(i, splits=chosen):
                tk.paged_attention_decode(q, caches[i % layers], seq_lens, bt, d ** -0.5,
                                          num_splits=splits, out=out, pdl=True)
            policy_us = graph_us(auto, 2 * layers)
            picked = tk._decode_kernel.best_config   # the autotuner's config for this launch
            picked = (picked.kwargs["BLOCK_N"], picked.num_warps, picked.num_stages)
            best = min(timings, key=timings.get)
            best_per_split = {sp: min(v for k, v in timings.items() if k[0] == sp)
                              for sp in SPLITS if any(k[0] == sp for k in timings)}
            kv_gbs = 2 * batch * ctx * kvh * d * caches[0].element_size() / (timings[best] * 1e3)
            print(f"b={batch:3d} ctx={ctx:5d}: best splits={best[0]:2d} cfg={best[1:]} "
                  f"{timings[best]:7.2f} us ({kv_gbs:6.0f} GB/s of K/V) | policy splits="
                  f"{chosen:2d} cfg={picked} {policy_us:7.2f} us | best per split: "
                  + " ".join(f"{sp}:{t:.1f}" for sp, t in best_per_split.items()), flush=True)
            rows.append({"batch": batch, "ctx": ctx, "kv": args.kv_dtype, "policy": chosen,
                         "policy_config": list(picked), "policy_us": policy_us,
                         "timings": {",".join(map(str, k)): v for k, v in timings.items()}})
            del caches
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
