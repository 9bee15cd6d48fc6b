"""GPU microbenchmark of folio's paged attention kernels against torch's SDPA backends
(flash, cuDNN, memory-efficient) on the same shapes, same process:

- prefill: one request's causal attention over a long prompt (the 8k TTFT's attention), and a
  chunk over a cached prefix (chunked prefill's later chunks);
- decode: a batch of requests, one query each (the offline workload's decode steps).

    python tools/gpu_bench_attention.py [--seq 8000] [--chunk 2048] [--batch 256 --ctx 600]
        [--kv-dtype fp8] [--kernel-file OLD/triton_kernels.py] [--json OUT.json]

`--kernel-file` times another version of folio/model/attention/triton_kernels.py (e.g. the
committed one, for a before/after in one process). Times: median of CUDA-event-timed calls
after warm-up (autotuning included in the warm-up); decode per call of a CUDA graph of calls
over enough copies of the cache (up to 8, >= 256 MiB) that K/V come from memory. TFLOP/s
counts causal work only (the visible query-key pairs, 4 * D flops each).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_sweep_decode_splits import graph_us  # noqa: E402


def load_kernels(path: str | None):
    if path is None:
        from folio.model.attention import triton_kernels
        return triton_kernels
    spec = importlib.util.spec_from_file_location("folio_attention_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def paged_cache(k: torch.Tensor, v: torch.Tensor, block_size: int, kv_dtype: torch.dtype):
    """k, v [T, KVH, D] -> a paged cache [2, blocks, block_size, KVH, D] with the pages in a
    shuffled order, and the block table [1, pages]."""
    t, kvh, d = k.shape
    pages = math.ceil(t / block_size)
    perm = torch.randperm(pages, device=k.device)
    cache = torch.zeros(2, pages, block_size, kvh, d, device=k.device, dtype=kv_dtype)
    pad = pages * block_size - t
    for i, x in enumerate((k, v)):
        x = F.pad(x, (0, 0, 0, 0, 0, pad)).view(pages, block_size, kvh, d)
        cache[i, perm] = x.to(kv_dtype)
    return cache, perm.to(torch.int32)[None, :]


def causal_pairs(q_len: int, ctx: int) -> int:
    """Visible (query, key) pairs: query i of q_len at position ctx + i sees ctx + i + 1 keys."""
    return q_len * ctx + q_len * (q_len + 1) // 2


def bench_prefill(mods: dict, seq: int, ctx: int, heads: int, kvh: int, d: int,
                  kv_dtype: torch.dtype, block_size: int) -> dict:
    """A q_len = seq - ctx chunk at the end of a seq-token context."""
    dev, dt = "cuda", torch.bfloat16
    q_len = seq - ctx
    q = torch.randn(q_len, heads, d, device=dev, dtype=dt)
    k = torch.randn(seq, kvh, d, device=dev, dtype=dt)
    v = torch.randn(seq, kvh, d, device=dev, dtype=dt)
    cache, bt = paged_cache(k, v, block_size, kv_dtype)
    qsl = torch.tensor([0, q_len], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([seq], device=dev, dtype=torch.int32)
    scale = d ** -0.5
    flops = 4 * d * heads * causal_pairs(q_len, ctx)
    row = {"case": f"prefill q={q_len} ctx={ctx}", "kv": str(kv_dtype).split(".")[-1]}
    for name, mod in mods.items():
        out = torch.empty_like(q)
        ms = time_ms(lambda: mod.paged_attention_varlen(
            q, cache, query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
            max_query_len=q_len, max_seq_len=seq, scale=scale, out=out))
        row[name] = (ms, flops / ms / 1e9)   # TFLOP/s
    if kv_dtype == dt:
        # torch's SDPA on contiguous K/V (no pages): bottom-right causal for a chunk
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        qt = q.transpose(0, 1)[None]
        kt, vt = (x.transpose(0, 1)[None].repeat_interleave(heads // kvh, 1) for x in (k, v))
        mask = None if ctx == 0 else causal_lower_right(q_len, seq)
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    def call():
                        if mask is None:
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
                    ref = call()
                    ms = time_ms(call)
                row[name] = (ms, flops / ms / 1e9)
            except Exception as exc:  # a backend not built for this shape / card
                row[name] = f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
        if ctx == 0:
            from folio.model.attention import dense_prefill
            out = torch.empty_like(q)
            ms = time_ms(lambda: dense_prefill.causal_attention(q, k, v, scale, out))
            row["folio-dense"] = (ms, flops / ms / 1e9)
            dense_out = out.clone()
            kg, vg = (x.transpose(0, 1)[None] for x in (k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ms = time_ms(lambda: F.scaled_dot_product_attention(
                        qt, kg, vg, is_causal=True, enable_gqa=True))
                row["sdpa-cudnn-gqa"] = (ms, flops / ms / 1e9)
            except Exception as exc:
                row["sdpa-cudnn-gqa"] = f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
        mine = next(iter(mods.values())).paged_attention_varlen(
            q, cache, query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
            max_query_len=q_len, max_seq_len=seq, scale=scale)
        with sdpa_kernel(SDPBackend.MATH):
            ref = (F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                  is_causal=True) if mask is None else
                   F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                  attn_mask=mask))
        row["max_err_vs_fp32"] = (mine.float() - ref[0].transpose(0, 1)).abs().max().item()
        if ctx == 0:
            row["dense_max_err_vs_fp32"] = (dense_out.float()
                                            - ref[0].transpose(0, 1)).abs().max().item()
    return row


def bench_decode(mods: dict, batch: int, ctx: int, heads: int, kvh: int, d: int,
                 kv_dtype: torch.dtype, block_size: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    pages_per = math.ceil(ctx / block_size)
    kv_bytes = 2 * batch * ctx * kvh * d * torch.empty((), dtype=kv_dtype).element_size()
    # Enough caches (as many layers') that the calls read K/V from memory, not the L2.
    copies = max(1, min(8, math.ceil((256 << 20) / kv_bytes)))
    caches = [torch.randn(2, batch * pages_per, block_size, kvh, d, device=dev,
                          dtype=dt).to(kv_dtype) for _ in range(copies)]
    bt = torch.randperm(batch * pages_per, device=dev, dtype=torch.int32).view(batch, pages_per)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, heads, d, device=dev, dtype=dt)
    row = {"case": f"decode b={batch} ctx={ctx}", "kv": str(kv_dtype).split(".")[-1]}
    for name, mod in mods.items():
        splits = mod.choose_num_splits(batch, kvh, ctx)
        out = torch.empty_like(q)

        def call(i, mod=mod, splits=splits, out=out):
            mod.paged_attention_decode(q, caches[i % copies], seq_lens, bt, d ** -0.5,
                                       num_splits=splits, out=out, pdl=True)
        call(0)   # autotuning, outside the graph
        # Timed in a CUDA graph as the engine runs decode: called one at a time through the
        # launcher, a ~0.1 ms kernel had measured its launch (session 30).
        ms = graph_us(call, 2 * copies) / 1e3
        row[name] = (ms, kv_bytes / ms / 1e6)   # GB/s of K/V read
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--kernel-file", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    mods = {"folio": load_kernels(None)}
    if args.kernel_file:
        mods["other"] = load_kernels(args.kernel_file)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    shape = (args.heads, args.kv_heads, args.head_dim)
    rows = [
        bench_prefill(mods, args.seq, 0, *shape, kv_dtype, args.block_size),
        bench_prefill(mods, args.seq, args.seq - args.chunk, *shape, kv_dtype, args.block_size),
        bench_decode(mods, args.batch, args.ctx, *shape, kv_dtype, args.block_size),
        bench_decode(mods, 1, args.seq, *shape, kv_dtype, args.block_size),
    ]
    for row in rows:
        cells = [f"{row['case']} kv={row['kv']}:"]
        unit = "GB/s" if row["case"].startswith("decode") else "TFLOP/s"
        for key, val in row.items():
            if key in ("case", "kv"):
                continue
            if isinstance(val, tuple):
                cells.append(f"{key} {val[0]:.3f} ms ({val[1]:.0f} {unit})")
            else:
                cells.append(f"{key} {val}")
        print("  ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
