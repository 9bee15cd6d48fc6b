"""Batched multi-LoRA (folio/model/kernels/lora.py) on the GPU next to the base projection it
rides on, at Llama-3-8B's shapes in bf16: qkv 4096 -> 6144 (slices 4096/1024/1024), o 4096 ->
4096, gate_up 4096 -> 2 x 14336, down 14336 -> 4096, at rank 16 with 8 adapter slots.

For each projection, token count and slot layout, every variant is checked once against a
float64 per-slot reference, then timed the way decode runs it: from a CUDA graph of --reps
back-to-back calls with PDL (--pdl 0: without), the median of --iters replays, per call;
next to the base bf16 F.linear of the same shape timed the same way. Slot layouts: "one" (one
adapter for every token) and "spread8" (8 adapters: token i on slot i % 8 up to 256 tokens, a
decode batch of one token per request; 8 contiguous runs at more tokens, a prefill batch of 8
requests). Variants:
- old: the kernels' choice before the fused and sorted paths, forced through _config:
  per-token shrink + expand up to 64 tokens, blocks of 32/64 rows in flat order beyond;
- new: what a LoRAProjection runs now (its _forward_triton, the slots and order from its
  LoRABatch): lora_shrink_expand up to FUSED_MAX_T tokens, else shrink + expand with the
  batch's token_order (per-token up to PER_TOKEN_MAX_T, sorted blocks beyond);
- fused: lora_shrink_expand at its default tiles (up to 16 tokens), and one
  "fused[BLOCK_N/BLOCK_K/SPLIT_K/warps]" per --fused-configs entry (tuning);
- token: the per-token shrink + expand (up to 256 tokens);
- sorted: shrink + expand in sorted 16-row blocks (token_order), at every token count;
- dense3: torch only: u = x @ A_all^T over all slots (cuBLAS), u *= each token's slot mask,
  y += u @ B_all (B block-diagonal over slots and slices): three launches, no Triton;
- mm+expand: u = x @ A_all^T (cuBLAS, bf16), then lora_expand reading each token's own
  slot's columns of u (u_slot_stride);
- cat: the base projection and the shrink as ONE cuBLAS GEMM against [W; A_all] (the LoRA
  rows ride on the weight stream the base reads anyway), then lora_expand from the output's
  tail columns into its head (strided views): timed with the base, reported minus the base.
JSON lines to stdout (and all rows to --out), then a table per layout: each variant's µs per
decoder layer (qkv + o + gate_up + down; the token counts all projections see), next to the
base projections' sum."""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

SLOTS = 8
# name -> (K, output slices)
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
          "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
FUSED_BENCH_MAX_T = 16
TOKEN_BENCH_MAX_T = 256
OLD_PER_TOKEN_MAX_T = 64   # the per-token threshold before the fused and sorted paths


def graph_us(fn: Callable[[], None], reps: int, iters: int) -> float:
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


def make_slots(layout: str, t: int) -> np.ndarray:
    if layout == "one":
        return np.zeros(t, dtype=np.int32)
    if t <= 256:
        return (np.arange(t) % SLOTS).astype(np.int32)
    return (np.arange(t) * SLOTS // t).astype(np.int32)


def reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              slices: tuple[int, ...], rank: int) -> torch.Tensor:
    """The LoRA update of every token in float64."""
    want = torch.zeros(x.shape[0], sum(slices), device=x.device, dtype=torch.float64)
    for s in slots.unique().tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        u = x[rows].double() @ a[s].double().t()
        off = 0
        for j, size in enumerate(slices):
            want[rows, off:off + size] = u[:, j * rank:(j + 1) * rank] \
                @ b[s, off:off + size].double().t()
            off += size
    return want


def variants(t: int, k: int, slices: tuple[int, ...], rank: int, fused_configs: list[tuple],
             pdl: bool) -> dict[str, Callable]:
    """name -> make(x, a, b, slots, order, buf, y, proj) -> a zero-argument call adding the
    LoRA update to y, for the variants that apply at t tokens."""
    from folio.model.kernels import lora
    r = len(slices) * rank

    def pair(shrink_cfg, expand_cfg, ordered: bool) -> Callable:
        def make(x, a, b, slots, order, buf, y, proj):
            o = order if ordered else None

            def call() -> None:
                lora.lora_shrink(x, a, slots, buf, token_order=o, pdl=pdl, _config=shrink_cfg)
                lora.lora_expand(buf, b, slots, y, slices, rank, token_order=o, pdl=pdl,
                                 _config=expand_cfg)
            return call
        return make

    def fused(cfg) -> Callable:
        def make(x, a, b, slots, order, buf, y, proj):
            return lambda: lora.lora_shrink_expand(x, a, b, slots, y, slices, rank, pdl=pdl,
                                                   _config=cfg)
        return make

    old_bm = 1 if t <= OLD_PER_TOKEN_MAX_T else lora._block_m(t, False)
    out: dict[str, Callable] = {
        "old": pair(lora._shrink_tiles(t, r, k, old_bm),
                    lora._expand_tiles(t, rank, min(32, old_bm)), False),
        "new": lambda x, a, b, slots, order, buf, y, proj: lambda: proj._forward_triton(x, y),
    }
    if t <= FUSED_BENCH_MAX_T:
        out["fused"] = fused(None)
        for cfg in fused_configs:
            out["fused[" + "/".join(map(str, cfg)) + "]"] = fused(cfg)
    if t <= TOKEN_BENCH_MAX_T:
        out["token"] = pair(lora._shrink_tiles(t, r, k, 1), lora._expand_tiles(t, rank, 1),
                            False)
    out["sorted"] = pair(lora._shrink_tiles(t, r, k, 16), lora._expand_tiles(t, rank, 16),
                         True)

    def dense3(x, a, b, slots, order, buf, y, proj):
        a_all = a.reshape(-1, k)
        b_all = block_diagonal(b, slices, rank)
        mask = slot_mask(slots, a.shape[0], r, x.dtype)
        u = torch.empty(t, a_all.shape[0], device=x.device, dtype=x.dtype)

        def call() -> None:
            torch.mm(x, a_all.t(), out=u)
            u.mul_(mask)
            y.addmm_(u, b_all)
        return call

    def mm_expand(x, a, b, slots, order, buf, y, proj):
        a_all = a.reshape(-1, k)
        u = torch.empty(t, a_all.shape[0], device=x.device, dtype=x.dtype)

        def call() -> None:
            torch.mm(x, a_all.t(), out=u)
            lora.lora_expand(u, b, slots, y, slices, rank, token_order=order, pdl=pdl,
                             u_slot_stride=r)
        return call

    out["dense3"] = dense3
    out["mm+expand"] = mm_expand
    return out


def block_diagonal(b: torch.Tensor, slices: tuple[int, ...], rank: int) -> torch.Tensor:
    """[S * n_slices * rank, N]: row s*R + j*rank + i holds b[s, slice j rows, i] in slice j's
    columns, zeros elsewhere, so u_all @ it applies every slot's B to its own slice."""
    s_count, n, _ = b.shape
    r = len(slices) * rank
    out = torch.zeros(s_count * r, n, device=b.device, dtype=b.dtype)
    for s in range(s_count):
        off = 0
        for j, size in enumerate(slices):
            out[s * r + j * rank:s * r + (j + 1) * rank, off:off + size] = \
                b[s, off:off + size].t()
            off += size
    return out


def slot_mask(slots: torch.Tensor, s_count: int, r: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S * r]: 1 in each token's own slot's r columns, 0 elsewhere (and for slot -1)."""
    cols = torch.arange(s_count * r, device=slots.device) // r
    return (cols[None, :] == slots.long()[:, None]).to(dtype)


def cat_row(x, w, a, b, slots, order, slices, rank, want, base, args, pdl, name, layout
            ) -> dict:
    """The "cat" variant: one GEMM against [W; A_all], then the expand from its tail."""
    from folio.model.kernels import lora
    t, k = x.shape
    n, r = sum(slices), len(slices) * rank
    w_cat = torch.cat([w, a.reshape(-1, k)])
    out = torch.empty(t, w_cat.shape[0], device=x.device, dtype=x.dtype)

    def call() -> None:
        torch.mm(x, w_cat.t(), out=out)
        lora.lora_expand(out[:, n:], b, slots, out[:, :n], slices, rank, token_order=order,
                         pdl=pdl, u_slot_stride=r)
    call()
    delta = out[:, :n].double() - F.linear(x, w).double()
    err = float((delta - want).norm() / want.norm())
    us = graph_us(call, args.reps, args.iters) - base
    return dict(shape=name, k=k, n=n, slices=list(slices), rank=rank, tokens=t, layout=layout,
                variant="cat", pdl=pdl, rel_err=err, base_us=base, lora_us=us,
                lora_over_base=us / base)


def summary(rows: list[dict]) -> None:
    """Per layout and token count: each variant's µs per decoder layer (the sum over the
    projections) and the base projections' sum."""
    shapes = sorted({row["shape"] for row in rows})
    for layout in dict.fromkeys(row["layout"] for row in rows):
        names = list(dict.fromkeys(row["variant"] for row in rows if row["layout"] == layout))
        print(f"\nlayout {layout}: µs per layer ({'+'.join(shapes)}), LoRA only")
        print(f"{'T':>5} {'base':>8} " + " ".join(f"{n:>12}" for n in names))
        for t in dict.fromkeys(row["tokens"] for row in rows):
            sel = [row for row in rows if row["layout"] == layout and row["tokens"] == t]
            base = {row["shape"]: row["base_us"] for row in sel}
            cells = []
            for name in names:
                got = {row["shape"]: row["lora_us"] for row in sel if row["variant"] == name}
                cells.append(f"{sum(got.values()):12.2f}" if len(got) == len(shapes)
                             else f"{'-':>12}")
            print(f"{t:>5} {sum(base.values()):8.2f} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--layouts", default="one,spread8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pdl", type=int, default=1, help="launch with PDL, as decode does")
    ap.add_argument("--fused-configs", default="",
                    help="extra fused tilings to time, BLOCK_N:BLOCK_K:SPLIT_K:warps,...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from folio.model.kernel_config import KernelConfig
    from folio.model.lora.projection import LoRABatch, LoRAProjection

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rank, pdl = args.rank, bool(args.pdl)
    tokens = [int(v) for v in args.tokens.split(",")]
    fused_configs = [tuple(int(v) for v in c.split(":")) for c in args.fused_configs.split(",")
                     if c]
    batch = LoRABatch(max(tokens), dev)
    kernels = KernelConfig(pdl="1" if pdl else "0")
    rows = []
    for name in args.shapes.split(","):
        k, slices = SHAPES[name]
        n, r = sum(slices), len(slices) * rank
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        proj = LoRAProjection(k, slices, SLOTS, rank, torch.bfloat16, dev, batch, kernels)
        a, b = proj.a, proj.b
        a.copy_(torch.randn(SLOTS, r, k, device=dev) * k ** -0.5)
        b.copy_(torch.randn(SLOTS, n, rank, device=dev) * rank ** -0.5)
        for t in tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            buf = torch.empty(t, r, device=dev)
            y = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
            base = graph_us(lambda: F.linear(x, w), args.reps, args.iters)
            for layout in args.layouts.split(","):
                batch.set(make_slots(layout, t))
                slots, order = batch.token_slots[:t], batch.token_order[:t]
                want = reference(x, a, b, slots, slices, rank)
                rows.append(cat_row(x, w, a, b, slots, order, slices, rank, want, base,
                                    args, pdl, name, layout))
                print(json.dumps(rows[-1]), flush=True)
                for variant, make in variants(t, k, slices, rank, fused_configs, pdl).items():
                    call = make(x, a, b, slots, order, buf, y, proj)
                    y.zero_()
                    call()
                    err = float((y.double() - want).norm() / want.norm())
                    us = graph_us(call, args.reps, args.iters)
                    row = dict(shape=name, k=k, n=n, slices=list(slices), rank=rank, tokens=t,
                               layout=layout, variant=variant, pdl=pdl, rel_err=err,
                               base_us=base, lora_us=us, lora_over_base=us / base)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(slots=SLOTS, rank=rank, reps=args.reps, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
