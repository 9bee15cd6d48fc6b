"""Batched multi-LoRA (folio/model/kernels/lora.py) on the GPU next to the base projection it
rides on, at Llama-3-8B's shapes in bf16: qkv 4096 -> 6144 (slices 4096/1024/1024), o 4096 ->
4096, gate_up 4096 -> 2 x 14336, down 14336 -> 4096, at rank 16 with 8 adapter slots.

For each projection, token count and slot layout: lora_shrink + lora_expand checked once
against a float64 per-slot reference, then timed the way decode runs them, from a CUDA graph
of --reps back-to-back calls (no launch gaps; median of --iters replays, per call), next to
the base bf16 F.linear of the same shape timed the same way. Slot layouts: "one" (one adapter
for every token) and "spread8" (8 adapters: token i on slot i % 8 up to 256 tokens, a decode
batch of one token per request; 8 contiguous runs at more tokens, a prefill batch of 8
requests). JSON lines to stdout and --out."""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SLOTS = 8
# name -> (K, output slices)
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
          "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def graph_us(fn, reps: int, iters: int) -> float:
    """µs per call of `fn`, from a CUDA graph of `reps` back-to-back calls."""
    fn()                                         # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def make_slots(layout: str, t: int, dev: torch.device) -> torch.Tensor:
    if layout == "one":
        slots = torch.zeros(t, dtype=torch.int32)
    elif t <= 256:
        slots = torch.arange(t, dtype=torch.int32) % SLOTS
    else:
        slots = (torch.arange(t) * SLOTS // t).to(torch.int32)
    return slots.to(dev)


def check(x, a, b, slots, slices, rank) -> float:
    """Relative error of shrink + expand's update against float64, on a zero y."""
    from folio.model.kernels.lora import lora_expand, lora_shrink
    t, n = x.shape[0], sum(slices)
    buf = torch.empty(t, a.shape[1], device=x.device)
    y = torch.zeros(t, n, device=x.device, dtype=x.dtype)
    lora_shrink(x, a, slots, buf)
    lora_expand(buf, b, slots, y, slices, rank)
    want = torch.zeros(t, n, device=x.device, dtype=torch.float64)
    for s in slots.unique().tolist():
        rows = (slots == s).nonzero().squeeze(1)
        u = x[rows].double() @ a[s].double().t()
        off = 0
        for j, size in enumerate(slices):
            want[rows, off:off + size] = u[:, j * rank:(j + 1) * rank] \
                @ b[s, off:off + size].double().t()
            off += size
    return float((y.double() - want).norm() / want.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,8,64,256,4096")
    ap.add_argument("--layouts", default="one,spread8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from folio.model.kernels.lora import lora_expand, lora_shrink

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rank = args.rank
    rows = []
    for name in args.shapes.split(","):
        k, slices = SHAPES[name]
        n, r = sum(slices), len(slices) * rank
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        a = (torch.randn(SLOTS, r, k, device=dev) * k ** -0.5).to(torch.bfloat16)
        b = (torch.randn(SLOTS, n, rank, device=dev) * rank ** -0.5).to(torch.bfloat16)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            buf = torch.empty(t, r, device=dev)
            y = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
            base = graph_us(lambda: F.linear(x, w), args.reps, args.iters)
            for layout in args.layouts.split(","):
                slots = make_slots(layout, t, dev)
                err = check(x, a, b, slots, slices, rank)
                shrink = graph_us(lambda: lora_shrink(x, a, slots, buf), args.reps, args.iters)
                expand = graph_us(lambda: lora_expand(buf, b, slots, y, slices, rank),
                                  args.reps, args.iters)
                y.zero_()   # the timed expands accumulated into it

                def both() -> None:
                    lora_shrink(x, a, slots, buf)
                    lora_expand(buf, b, slots, y, slices, rank)

                lora = graph_us(both, args.reps, args.iters)
                row = dict(shape=name, k=k, n=n, slices=list(slices), rank=rank, tokens=t,
                           layout=layout, rel_err=err, base_us=base, shrink_us=shrink,
                           expand_us=expand, lora_us=lora, lora_over_base=lora / base)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(slots=SLOTS, rank=rank, reps=args.reps, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
