"""GPU check and timing of the skinny (few-row) Triton matmul vs cuBLAS F.linear.

Run on the GPU machine from the repository root:
    python tools/gpu_check_gemv.py [--models qwen3-0.6b,llama-3-8b] [--m 1,2,4,8] [--timings]

For each projection of Qwen3-0.6B and Llama-3-8B (qkv, o, gate_up, down) and each M, bf16:
1. Error: max |out - ref| against F.linear in fp32 on the same bf16 inputs, for the skinny
   kernel and for cuBLAS (for scale), and whether two skinny runs are bitwise equal (split-K
   must be deterministic). gate_up also runs the fused gate_up+SiLU-and-mul kernel, checked
   against F.linear + silu_and_mul.
2. Time per call: a CUDA graph of back-to-back calls, each on its own copy of the weight (the
   copies together are several times the L2, as a model's layers are), replayed several times:
   launch overhead excluded, as the engine's decode graphs run them. Prints µs per call and
   the weight bytes streamed per second.
The autotuner's choice per shape is printed; --timings prints every config's time as well.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folio.model.kernels import gemv  # noqa: E402
from folio.model.kernels.activation import silu_and_mul  # noqa: E402

# (name, N, K) per model; gate_up rows are 2 * intermediate.
SHAPES = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336)],
}


def graph_time_us(fns: list, replays: int = 20) -> float:
    """Mean µs per call of the calls in `fns`, captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:  # compiled and tuned already; settle allocations
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    return best


def config_str(kernel) -> str:
    c = kernel.best_config
    k = c.kwargs
    return (f"{'dot' if k['DOT'] else 'fma'}/N{k['BLOCK_N']}/K{k['BLOCK_K']}/S{k['SPLIT_K']}/"
            f"w{c.num_warps}/s{c.num_stages}")


def print_timings(kernel, top: int = 5) -> None:
    """The autotuner's own timings (L2 flushed before each run) of its best `top` configs."""
    timings = getattr(kernel, "configs_timings", None) or {}
    for cfg, t in sorted(timings.items(), key=lambda kv: kv[1][0])[:top]:
        k = cfg.kwargs
        print(f"      {'dot' if k['DOT'] else 'fma'} N{k['BLOCK_N']:<3d} K{k['BLOCK_K']:<5d} "
              f"S{k['SPLIT_K']} w{cfg.num_warps} s{cfg.num_stages}: {t[0] * 1e3:8.2f} µs")


def check_layers(dev: torch.device) -> int:
    """folio.model.layers on CUDA bf16 at decode sizes vs the same layers with the GEMV off
    (KernelConfig gemv "0", what FOLIO_GEMV=0 resolves to)."""
    from folio.model.kernel_config import KernelConfig
    from folio.model.layers import GatedMLP, Linear
    torch.manual_seed(0)
    fails = 0
    # The layers keep the KernelConfig they are built with (FOLIO_GEMV is read once, at model
    # load), so the cuBLAS side is a second pair of layers holding the same weights.
    on, off = KernelConfig(gemv="1"), KernelConfig(gemv="0")
    lin = Linear(3072, 1024, bias=True, kernels=on).to(dev, torch.bfloat16)
    mlp = GatedMLP(1024, 3072, bias=False, act="silu", kernels=on).to(dev, torch.bfloat16)
    lin0 = Linear(3072, 1024, bias=True, kernels=off).to(dev, torch.bfloat16)
    mlp0 = GatedMLP(1024, 3072, bias=False, act="silu", kernels=off).to(dev, torch.bfloat16)
    lin0.load_state_dict(lin.state_dict())
    mlp0.load_state_dict(mlp.state_dict())
    for m in (1, 3, 8, 9):
        x = torch.randn(m, 3072, device=dev, dtype=torch.bfloat16)
        h = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            y, z = lin(x), mlp(h)
            y0, z0 = lin0(x), mlp0(h)
        ey = (y.float() - y0.float()).abs().max().item()
        ez = (z.float() - z0.float()).abs().max().item()
        ok = (ey <= 0.02 * y0.float().abs().max().item()
              and ez <= 0.02 * z0.float().abs().max().item())
        fails += not ok
        print(f"layers M={m}: Linear max diff {ey:.2e}, GatedMLP max diff {ez:.2e} "
              f"{'OK' if ok else 'FAIL'}")
    return fails


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--m", default="1,2,4,8")
    ap.add_argument("--timings", action="store_true", help="print every autotune config's time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    ms = [int(v) for v in args.m.split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    fails = check_layers(dev)
    print(f"{'model':11s} {'proj':8s} {'N':>6s} {'K':>6s} {'M':>2s} | {'err skinny':>10s} "
          f"{'err cublas':>10s} det | {'cublas us':>9s} {'TB/s':>5s} | {'skinny us':>9s} "
          f"{'TB/s':>5s} {'speedup':>7s} | config")
    for model in args.models.split(","):
        for name, N, K in SHAPES[model]:
            wbytes = N * K * 2
            copies = max(4, min(64, math.ceil(512e6 / wbytes)))
            ws = [torch.randn(N, K, device=dev, dtype=dt, generator=gen) * K ** -0.5
                  for _ in range(copies)]
            for M in ms:
                x = torch.randn(M, K, device=dev, dtype=dt, generator=gen)
                w = ws[0]
                ref = F.linear(x.float(), w.float())
                out = gemv.skinny_matmul(x, w)
                again = gemv.skinny_matmul(x, w)
                cub = F.linear(x, w)
                err = (out.float() - ref).abs().max().item()
                err_cub = (cub.float() - ref).abs().max().item()
                det = torch.equal(out, again)
                ok = det and err <= 2 * err_cub + 1e-3
                fails += not ok
                cfg = config_str(gemv._skinny_kernel)
                outs = [torch.empty(M, N, device=dev, dtype=dt) for _ in ws]
                t_cub = graph_time_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o)
                                       for w, o in zip(ws, outs)])
                t_sk = graph_time_us([lambda w=w, o=o: gemv.skinny_matmul(x, w, out=o)
                                      for w, o in zip(ws, outs)])
                print(f"{model:11s} {name:8s} {N:6d} {K:6d} {M:2d} | {err:10.2e} {err_cub:10.2e} "
                      f"{'yes' if det else 'NO '} | {t_cub:9.2f} {wbytes / t_cub / 1e6:5.2f} | "
                      f"{t_sk:9.2f} {wbytes / t_sk / 1e6:5.2f} {t_cub / t_sk:7.2f} | {cfg}"
                      f"{' (layer: skinny)' if gemv.skinny_preferred(M, N, K) else ''}"
                      f"{'' if ok else '  FAIL'}", flush=True)
                if args.timings:
                    print_timings(gemv._skinny_kernel)
                if name == "gate_up":
                    inner = N // 2
                    ref2 = silu_and_mul(F.linear(x, w))
                    out2 = gemv.skinny_gate_up_silu(x, w)
                    again2 = gemv.skinny_gate_up_silu(x, w)
                    ref2_32 = F.silu(ref[:, :inner]) * ref[:, inner:]
                    err2 = (out2.float() - ref2_32).abs().max().item()
                    err2_unf = (ref2.float() - ref2_32).abs().max().item()
                    diff = (out2.float() - ref2.float()).abs().max().item()
                    det2 = torch.equal(out2, again2)
                    ok2 = det2 and err2 <= 2 * err2_unf + 1e-3
                    fails += not ok2
                    cfg2 = config_str(gemv._skinny_gate_up_kernel)
                    t_unf = graph_time_us([lambda w=w: silu_and_mul(F.linear(x, w)) for w in ws])
                    t_fused = graph_time_us([lambda w=w: gemv.skinny_gate_up_silu(x, w)
                                             for w in ws])
                    print(f"{model:11s} {'gu+silu':8s} {N:6d} {K:6d} {M:2d} | {err2:10.2e} "
                          f"{err2_unf:10.2e} {'yes' if det2 else 'NO '} | {t_unf:9.2f} "
                          f"{wbytes / t_unf / 1e6:5.2f} | {t_fused:9.2f} "
                          f"{wbytes / t_fused / 1e6:5.2f} {t_unf / t_fused:7.2f} | {cfg2}  "
                          f"(max |fused - unfused| {diff:.1e}){'' if ok2 else '  FAIL'}",
                          flush=True)
                    if args.timings:
                        print_timings(gemv._skinny_gate_up_kernel)
            del ws
            torch.cuda.empty_cache()
    print("(layer: skinny) = folio.model.layers.Linear would take the skinny kernel here "
          "(skinny_preferred); gu+silu always does in GatedMLP")
    print("unfused gate_up column: cublas F.linear + Triton silu_and_mul; error columns for "
          "gu+silu: fused vs fp32 reference, unfused vs fp32 reference")
    print("ALL OK" if not fails else f"{fails} FAILED")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
