"""The fused-MoE layer on the GPU against its bytes-read floor (issue 18's target: within 1.3x
at batch 1), at Qwen3-30B-A3B's expert shapes (128 experts, H 2048, I 768, top 8), bf16.

For each batch size: the Triton grouped GEMM (`fused_experts`) and the per-expert torch path
(`FusedMoE._grouped_torch`, the peer in the same run) checked against each other, then timed
with CUDA events (median of 50 after warm-up, each call on fresh routes drawn beforehand), eager
and replayed from a CUDA graph (one replay per call: its launch is timed too), and chained:
--calls-per-graph calls on different routes in one graph, per call (a decode graph's way:
the layers run back to back, no launch each); the floor is the bytes of the distinct experts the routes touch over the copy ceiling (--peak,
TB/s, measured on the H200 at 4.29). JSON lines to stdout and --out. --sweep: the few-token
form's tiles instead (sweep()), best per batch on a line starting "BEST"."""
from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch


def graph_timed(fn, routes: list) -> float:
    """The layer as decode runs it, in a CUDA graph (no launch overhead): captured once on a
    static ids buffer, each replay after copying the next routes into it (the copy is timed
    too: the model's router writes them in place the same way)."""
    static = routes[0].clone()
    fn(static)                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static)
    times = []
    for i, ids in enumerate(routes):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        static.copy_(ids)
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def chain_timed(fn, routes: list, calls: int, iters: int) -> float:
    """Seconds per layer call when `calls` calls with different routes run in one CUDA graph,
    as a decode step's graph runs a model's MoE layers one after another: no launch per call,
    and each call reads other experts (few hits in the L2). Routes are copied in before each
    replay, outside the timing."""
    statics = [routes[i % len(routes)].clone() for i in range(calls)]
    for ids in statics:
        fn(ids)                                  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for ids in statics:
            fn(ids)
    times = []
    for it in range(iters + 3):
        for j, ids in enumerate(statics):
            ids.copy_(routes[(it * calls + j) % len(routes)])
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if it >= 3:
            times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def sweep(moe, batches: list[int], E: int, H: int, k: int, floor_of, calls: int,
          iters: int, scales: dict) -> list[dict]:
    """The few-token form's tiles (kernels/moe_gemv.py `_config`) at each batch: gate_up's
    tile with the default down tile, then down's with the best gate_up, then num_stages; each
    config timed by chain_timed and checked against the default config's output."""
    from folio.model.kernels.moe_gemv import few_token_experts
    dev = moe.gate_up_proj.device
    found = []
    for batch in batches:
        x = torch.randn(batch, H, device=dev, dtype=torch.bfloat16)
        routes = [torch.rand(batch, E, device=dev).topk(k, dim=-1).indices
                  for _ in range(4 * calls)]
        w = torch.rand(batch, k, device=dev).softmax(-1)
        floor = floor_of(routes)
        with torch.no_grad():
            ref = few_token_experts(x, moe.gate_up_proj, moe.down_proj, w, routes[0],
                                    **scales).float()

        def run(config: dict) -> float | None:
            fn = lambda ids: few_token_experts(x, moe.gate_up_proj, moe.down_proj, w, ids,
                                               _config=config, **scales)
            try:
                with torch.no_grad():
                    out = fn(routes[0]).float()
                    err = float((out - ref).norm() / ref.norm())
                    if err > 1e-2:
                        print(json.dumps(dict(batch=batch, config=str(config), rel_err=err)))
                        return None
                    t = chain_timed(fn, routes, calls, iters)
            except Exception as exc:          # a tile the compiler refuses (registers, smem)
                print(json.dumps(dict(batch=batch, config=str(config),
                                      error=f"{type(exc).__name__}: {str(exc)[:120]}")))
                return None
            print(json.dumps(dict(batch=batch, config=str(config), us=round(t * 1e6, 2),
                                  over_floor=round(t / floor, 3))), flush=True)
            return t

        base = run({})
        best, best_t = {}, base if base is not None else float("inf")
        tiles = lambda ns, ks: list(itertools.product(ns, ks, (2, 4, 8)))  # noqa: E731
        # one knob at a time, each from the best so far
        for key, values in (("gate_up", tiles((2, 4, 8, 16), (256, 512, 1024))),
                            ("down", tiles((1, 2, 4, 8), (128, 256, 512))),
                            ("stages", (1, 3, 4))):
            for value in values:
                config = dict(best, **{key: value})
                t = run(config)
                if t is not None and t < best_t:
                    best, best_t = config, t
        row = dict(batch=batch, floor_us=floor * 1e6, default_us=(base or 0) * 1e6,
                   best_us=best_t * 1e6, best_over_floor=best_t / floor, best=str(best))
        print("BEST " + json.dumps(row), flush=True)
        found.append(row)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,2,4,8,16,64,256")
    ap.add_argument("--peak", type=float, default=4.29)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls-per-graph", type=int, default=8,
                    help="layer calls (each on other routes) per CUDA graph for the chained "
                         "figure: a decode graph's way, without one launch per layer")
    ap.add_argument("--sweep", action="store_true",
                    help="sweep the few-token form's tiles at the batches up to 4 instead")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 experts (--quantization fp8: e4m3 codes, a scale per expert row); "
                         "the floor counts their bytes")
    args = ap.parse_args()
    from folio.model.kernels.fused_moe import fused_experts
    from folio.model.moe.layer import FusedMoE
    from folio.model.kernel_config import KernelConfig, resolve_kernel_config

    dev = torch.device("cuda")
    E, H, I, k = args.experts, args.hidden, args.inter, args.top_k
    torch.manual_seed(0)
    moe = FusedMoE(E, H, I, "silu", resolve_kernel_config()).to(dev, torch.bfloat16)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.02)
        moe.down_proj.normal_(0, 0.02)
    expert_bytes = (2 * I * H + H * I) * 2
    scales = {}
    if args.fp8:
        moe.quantize_fp8()
        expert_bytes = (2 * I * H + H * I) * 1 + (2 * I + H) * 4
        scales = dict(gate_up_scale=moe.gate_up_scale, down_scale=moe.down_scale)

    def floor_of(routes: list) -> float:
        touched = statistics.median(int(r.unique().numel()) for r in routes)
        return touched * expert_bytes / (args.peak * 1e12)

    if args.sweep:
        from folio.model.kernels.moe_gemv import MAX_TOKENS
        rows = sweep(moe, [b for b in (int(b) for b in args.batches.split(","))
                           if b <= MAX_TOKENS], E, H, k, floor_of, args.calls_per_graph,
                     args.iters, scales)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(shape=dict(experts=E, hidden=H, inter=I, top_k=k), sweep=rows),
                          f, indent=2)
        return
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, H, device=dev, dtype=torch.bfloat16)
        routes = [torch.rand(batch, E, device=dev).topk(k, dim=-1).indices
                  for _ in range(args.iters + 5)]
        w = torch.rand(batch, k, device=dev).softmax(-1)
        with torch.no_grad():
            fused = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, routes[0], **scales)
            ref = moe._grouped_torch(x, w, routes[0])
        err = float((fused.float() - ref.float()).norm() / ref.float().norm())

        def timed(fn) -> float:
            times = []
            for i, ids in enumerate(routes):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(ids)
                end.record()
                end.synchronize()
                if i >= 5:
                    times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)

        with torch.no_grad():
            t_fused = timed(lambda ids: fused_experts(x, moe.gate_up_proj, moe.down_proj, w, ids,
                                                  **scales))
            t_torch = timed(lambda ids: moe._grouped_torch(x, w, ids))
            t_graph = graph_timed(lambda ids: fused_experts(x, moe.gate_up_proj, moe.down_proj,
                                                            w, ids, **scales), routes)
            # the grouped GEMMs forced where the few-token form serves (the same run's peer)
            t_grouped = graph_timed(lambda ids: fused_experts(
                x, moe.gate_up_proj, moe.down_proj, w, ids, few_tokens=False, **scales), routes)
            t_chain = chain_timed(lambda ids: fused_experts(
                x, moe.gate_up_proj, moe.down_proj, w, ids, **scales), routes, args.calls_per_graph,
                args.iters)
            grouped = fused_experts(x, moe.gate_up_proj, moe.down_proj, w, routes[0],
                                    few_tokens=False, **scales)
            err_grouped = float((grouped.float() - ref.float()).norm() / ref.float().norm())
        touched = statistics.median(int(r.unique().numel()) for r in routes)
        floor = touched * expert_bytes / (args.peak * 1e12)
        row = dict(batch=batch, experts_touched=touched, rel_err_vs_torch=err,
                   fused_us=t_fused * 1e6, torch_us=t_torch * 1e6, floor_us=floor * 1e6,
                   fused_over_floor=t_fused / floor, fused_speedup_vs_torch=t_torch / t_fused,
                   graph_us=t_graph * 1e6, graph_over_floor=t_graph / floor,
                   grouped_graph_us=t_grouped * 1e6, rel_err_grouped=err_grouped,
                   chained_us=t_chain * 1e6, chained_over_floor=t_chain / floor)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shape=dict(experts=E, hidden=H, inter=I, top_k=k), rows=rows), f,
                      indent=2)


if __name__ == "__main__":
    main()
