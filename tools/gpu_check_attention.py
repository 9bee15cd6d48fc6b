"""GPU check and timing of the Triton paged attention against the torch reference.

Run on the GPU machine from the repository root:
    python tools/gpu_check_attention.py [--quick]

1. Correctness (bf16/fp16/fp32) at realistic sizes: mixed batches (64 decodes x ~1k context with
   fresh, prefix-cached and chunked prefills), an 8k fresh prefill, split-K decode, a sliding
   window. Reference: TorchPagedAttention on fp32 upcasts of the same inputs. Outputs are
   poisoned with NaN first; every element must be written.
2. Timing with triton.testing.do_bench (median): decode B in {1, 32, 256} x context 512..8k,
   and prefills, Triton backend vs torch reference (both through `forward`, cache write
   included). Prints a table; writes everything to $OUT/attention.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.model.attention.backend import AttentionMetadata  # noqa: E402
from folio.model.attention import triton_kernels as tk  # noqa: E402
from folio.model.attention.torch_paged import TorchPagedAttention  # noqa: E402
from folio.model.attention.triton_backend import TritonPagedAttention  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def make_step(reqs: list[tuple[int, int]], H: int, KVH: int, D: int, bs: int,
              dtype: torch.dtype, seed: int) -> tuple:
    """Random q/k/v, a randomly filled cache, shuffled block tables. reqs: (computed, q_len)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ctx = [c + n for c, n in reqs]
    nbs = [-(-L // bs) for L in ctx]
    num_blocks = sum(nbs) + 8
    perm = torch.randperm(num_blocks, generator=g, device=DEV)
    tables = torch.zeros(len(reqs), max(nbs) + 1, dtype=torch.int64, device=DEV)
    pos = 0
    slot_parts, qsl = [], [0]
    for i, ((c, n), nb) in enumerate(zip(reqs, nbs)):
        tables[i, :nb] = perm[pos:pos + nb]
        pos += nb
        p = torch.arange(c, c + n, device=DEV)
        slot_parts.append(tables[i, p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    q = torch.randn(T, H, D, generator=g, device=DEV).to(dtype)
    k = torch.randn(T, KVH, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(T, KVH, D, generator=g, device=DEV).to(dtype)
    cache = torch.randn(2, num_blocks, bs, KVH, D, generator=g, device=DEV).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts), query_start_loc=qsl,
                             seq_lens=ctx, num_computed_tokens=[c for c, _ in reqs],
                             block_tables=tables, block_size=bs)
    return q, k, v, cache, meta


def fresh_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                             meta.num_computed_tokens, meta.block_tables, meta.block_size)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check(name: str, reqs, H, KVH, D, bs, dtype, win=None, splits=(1,), seed=0) -> list[dict]:
    q, k, v, cache, meta = make_step(reqs, H, KVH, D, bs, dtype, seed)
    scale = D ** -0.5
    ref_cache = cache.float()
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), ref_cache,
                                        fresh_meta(meta), scale=scale, sliding_window=win)
    be = TritonPagedAttention()
    st = be.step_tensors(meta)
    tri_cache = cache.clone()
    tk.reshape_and_cache(k, v, tri_cache, st.slot_mapping)
    torch.cuda.synchronize()
    rows = []
    cache_ok = bool(torch.equal(tri_cache.float(), ref_cache))
    outs = {}
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_varlen(q, tri_cache, query_start_loc=st.query_start_loc,
                              seq_lens=st.seq_lens, block_tables=st.block_tables,
                              max_query_len=st.max_query_len, max_seq_len=st.max_seq_len,
                              scale=scale, sliding_window=win, out=out)
    outs["varlen"] = out
    if st.all_decode:
        for s in splits:
            out = torch.full_like(q, float("nan"))
            tk.paged_attention_decode(q, tri_cache, st.seq_lens, st.block_tables, scale, win,
                                      num_splits=s, out=out)
            outs[f"decode_s{s}"] = out
    # The full backend path (its own split choice).
    be_cache = cache.clone()
    outs["backend"] = be.forward(q, k, v, be_cache, fresh_meta(meta), scale=scale,
                                 sliding_window=win)
    torch.cuda.synchronize()
    for label, o in outs.items():
        err = rel_err(o, ref)
        written = bool(torch.isfinite(o).all())
        ok = written and cache_ok and err < TOL[dtype]
        rows.append(dict(case=name, path=label, dtype=str(dtype).split(".")[-1], rel_err=err,
                         all_written=written, cache_equal=cache_ok, ok=ok))
    return rows


def correctness(quick: bool) -> list[dict]:
    rows: list[dict] = []
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    mixed = [(0, 300), (700, 200), (1500, 512)] + [(1000 + 7 * i, 1) for i in range(64)]
    for dt in dtypes:
        rows += check("mixed_64dec_1k_g4_d128", mixed, 32, 8, 128, 16, dt, seed=1)
        rows += check("mixed_g1_d64_bs32_window", mixed[:20], 8, 8, 64, 32, dt, win=256, seed=2)
        rows += check("decode_64x1k_g4", [(1000 + 13 * i, 1) for i in range(64)], 32, 8, 128,
                      16, dt, splits=(1, 4, 16), seed=3)
        rows += check("decode_long_window_g8", [(8000, 1), (3000, 1), (5, 1)], 64, 8, 128, 16,
                      dt, win=4096, splits=(1, 8, 32), seed=4)
        if not quick:
            rows += check("prefill_8k_g4", [(0, 8192)], 32, 8, 128, 16, dt, seed=5)
            rows += check("chunk_2k_over_6k_g2_d64", [(6144, 2048)], 16, 8, 64, 32, dt, seed=6)
    return rows


def bench(fn, reps_ms: int = 200) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median"))


def time_case(name: str, reqs, H=32, KVH=8, D=128, bs=16, dtype=torch.bfloat16) -> dict:
    q, k, v, cache, meta = make_step(reqs, H, KVH, D, bs, dtype, seed=11)
    scale = D ** -0.5
    tri, ref = TritonPagedAttention(), TorchPagedAttention()
    m_tri, m_ref = fresh_meta(meta), fresh_meta(meta)
    c_tri, c_ref = cache.clone(), cache.clone()
    tri.forward(q, k, v, c_tri, m_tri, scale=scale)  # compile + autotune + step tensors
    torch.cuda.synchronize()
    t_tri = bench(lambda: tri.forward(q, k, v, c_tri, m_tri, scale=scale))
    try:
        ref.forward(q, k, v, c_ref, m_ref, scale=scale)
        t_ref = bench(lambda: ref.forward(q, k, v, c_ref, m_ref, scale=scale))
    except torch.OutOfMemoryError:
        t_ref = float("nan")
    del c_ref
    # Floor terms: K/V bytes read (each visible key once per KV head) and causal QK^T + PV flops.
    kv_bytes = sum(meta.seq_lens) * KVH * D * 2 * cache.element_size()
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in reqs)
    flops = 4 * pairs * H * D
    st = tri.step_tensors(m_tri)  # the step's tensors, cached in m_tri by the forward passes
    splits = tri.num_splits(st, KVH, q.device) if st.all_decode else None
    return dict(case=name, triton_ms=t_tri, torch_ms=t_ref, speedup=t_ref / t_tri,
                kv_GBps=kv_bytes / t_tri / 1e6, TFLOPs=flops / t_tri / 1e9, splits=splits)


def timings(quick: bool) -> list[dict]:
    rows = []
    ctxs = [512, 2048, 8192] if not quick else [2048]
    for B in (1, 32, 256):
        for L in ctxs:
            reqs = [(L - 1, 1)] * B
            rows.append(time_case(f"decode B={B} ctx={L}", reqs))
    rows.append(time_case("prefill 8k fresh", [(0, 8192)]))
    rows.append(time_case("prefill 4x2k fresh", [(0, 2048)] * 4))
    rows.append(time_case("chunk 2k over 6k", [(6144, 2048)]))
    rows.append(time_case("mixed 1x512 chunk + 64 dec@1k", [(1024, 512)] + [(1000, 1)] * 64))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton
    info["triton"] = triton.__version__
    print(info, flush=True)

    corr = correctness(args.quick)
    print(f"\n{'case':34s} {'path':10s} {'dtype':9s} {'rel_err':>9s} written ok")
    for r in corr:
        print(f"{r['case']:34s} {r['path']:10s} {r['dtype']:9s} {r['rel_err']:9.2e} "
              f"{str(r['all_written']):7s} {'OK' if r['ok'] else 'FAIL'}")
    n_fail = sum(not r["ok"] for r in corr)
    print(f"correctness: {len(corr) - n_fail}/{len(corr)} ok ({time.time() - t0:.0f}s)", flush=True)

    times = [] if args.skip_timing else timings(args.quick)
    configs = {}
    for name in ("_varlen_kernel", "_decode_kernel", "_reshape_and_cache_kernel"):
        cfg = getattr(getattr(tk, name), "best_config", None)
        configs[name] = str(cfg)
    if times:
        print(f"\n{'case (bf16, H=32 KVH=8 D=128 bs=16)':36s} {'triton ms':>10s} {'torch ms':>10s}"
              f" {'speedup':>8s} {'KV GB/s':>8s} {'TFLOP/s':>8s} splits")
        for r in times:
            print(f"{r['case']:36s} {r['triton_ms']:10.4f} {r['torch_ms']:10.4f} "
                  f"{r['speedup']:8.2f} {r['kv_GBps']:8.0f} {r['TFLOPs']:8.1f} {r['splits']}")
    print("best configs:", configs)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "attention.json"), "w") as f:
            json.dump(dict(info=info, correctness=corr, timings=times, configs=configs), f,
                      indent=1)
    print(f"total {time.time() - t0:.0f}s")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
